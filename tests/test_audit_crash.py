"""Layout-only crashes are findings of kind ``crash`` (the exception, its megatron-core frame,
the trigger, and that one rank runs the case); a layout Megatron's config refuses is not one."""

import pytest

pytest.importorskip("megatron.core")

from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow
AFFINE = (("projection", "affine"),)
SPLIT = (("account_for_embedding_in_pipeline_split", True),)  # 3 middle layers on 2 stages


@pytest.fixture(scope="module")
def result(audit_pools):
    return audit([Case("multimodal", (), Layout(tp=2)), Case("multimodal", AFFINE, Layout(tp=2)),
                  Case("gpt", SPLIT, Layout(pp=2)), Case("gpt", (("loss_mask", True),), Layout(pp=2))],
                 run_pools=audit_pools)


def test_a_crash_only_a_layout_causes_is_a_finding_with_its_frame(result):
    [crash] = [f for f in result.findings if f.kind == "crash"]
    assert crash.trigger == {"component": "multimodal", "options": {"projection": "affine"}, "layout": "tp2"}
    assert crash.location.startswith("megatron/core/") and crash.location.rsplit(":", 1)[1].isdigit()
    assert "RuntimeError" in crash.contract and "one rank" in crash.one_rank
    assert crash.reproduce == "shardcheck audit --only multimodal --layouts tp2 --set projection=affine"
    assert crash.effect == [] and crash.control is None
    assert crash.training_args is None  # pretrain_gpt builds no LLaVA: megatron.training is not asked
    # a shape mismatch in a forward is no argument check (tests/test_audit_refusals.py)
    assert not [entry for entry in result.refused if entry.startswith("multimodal")]
    # the defaults run under tp2: the crash is the option's
    assert any(o.case == Case("multimodal", (), Layout(tp=2)) and not o.error for o in result.outcomes)


def test_a_layout_megatrons_config_refuses_is_not_applicable_not_a_crash(result):
    assert not [f for f in result.findings if f.trigger["component"] == "gpt"]
    # the refusal closes that option under pp2, not the layout: another option still runs there
    assert any(o.case.options == (("loss_mask", True),) and not o.error for o in result.outcomes)
    assert any(entry.startswith("gpt[account_for_embedding_in_pipeline_split=True] @ pp2: "
                                "megatron-core refuses it: ValueError") for entry in result.refused)
    assert any(entry.startswith("gpt[account_for_embedding_in_pipeline_split=True] @ pp2: "
                                "megatron-core refuses it: ValueError") for entry in result.not_applicable)
