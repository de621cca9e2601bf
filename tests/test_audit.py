"""The audit on real megatron-core: known bugs found with numbers and locations, none on correct layouts."""

import pytest

pytest.importorskip("megatron.core")

from shardcheck.layout import Layout  # noqa: E402
from shardcheck.megatron.audit import PRELOAD, audit, pools  # noqa: E402
from shardcheck.megatron.sweep import Case  # noqa: E402

pytestmark = pytest.mark.slow
for module in PRELOAD:
    __import__(module)

KNOWN = {  # trigger, location, checker line (None: numeric-only)
    "label smoothing": (Case("output_loss", (("label_smoothing", 0.1),), Layout(tp=2)),
                        "tensor_parallel/cross_entropy.py",
                        "checker: mean over shard at megatron/core/tensor_parallel/cross_entropy.py:"),
    "cp loss": (Case("gpt", (("loss_mask", True), ("optimizer_step", False)), Layout(cp=2)),
                "pipeline_parallel/schedules.py",
                "checker: non-linear on partial at megatron/core/pipeline_parallel/schedules.py:262"),
    "router count": (Case("moe_router", (("padding", True),), Layout(tp=2, sp=True)),
                     "transformer/moe/moe_utils.py",
                     "checker: contract at megatron/core/transformer/moe/router.py:"),
}
CORRECT = ["tp2", "tp2-sp", "dp2", "pp2", "cp2", "tp2-dp2-sp", "cp2-dp2", "tp2-pp2", "tp2-cp2",
           "cp2-pp2"]
RIGHT_OPTIONS = [(("cross_entropy_loss_fusion", True),), (("softmax_type", "off-by-one"),)]


@pytest.fixture(scope="module")
def warm():
    with pools() as shared:
        yield shared


@pytest.fixture(scope="module")
def known(warm):
    return audit([case for case, _, _ in KNOWN.values()], run_pools=warm)


@pytest.mark.parametrize("name", list(KNOWN))
def test_known_bug_is_found_with_location_numbers_and_corrected_control(known, name):
    case, where, checker = KNOWN[name]
    [finding] = [f for f in known.findings if f.trigger["component"] == case.component]
    assert (finding.checker or "").startswith(checker or "") and (checker is None) == (finding.checker is None)
    assert finding.kind == ("numeric-only" if checker is None else "type+numeric")
    assert where in finding.location and finding.location.rsplit(":", 1)[1].isdigit()
    assert finding.trigger["layout"] == str(case.layout)
    assert finding.effect and finding.effect[0]["max_abs_error"] > 1e-4
    assert finding.effect[0]["observed"] != finding.effect[0]["reference"]
    assert finding.corrected is not None and finding.corrected["equal_to_reference"], finding.corrected
    assert finding.reproduce.startswith(f"shardcheck audit --only {case.component} --layouts {case.layout}")
    assert "ensures" in finding.contract or "requires" in finding.contract


def test_known_bugs_are_three_distinct_findings(known):
    assert len(known.findings) == 3 and len({f.id for f in known.findings}) == 3


def test_plain_gpt_on_correct_layouts_gives_no_finding(warm):
    result = audit([Case("gpt", (), Layout.parse(text)) for text in CORRECT], run_pools=warm)
    assert not result.errors, [o.error for o in result.errors]
    assert len(result.outcomes) == len(CORRECT)
    assert result.findings == []  # type-only included: CP's per-rank count of an all-ones mask


def test_options_megatron_gets_right_under_tp_give_no_finding(warm):
    result = audit([Case("gpt", options, Layout(tp=2)) for options in RIGHT_OPTIONS], run_pools=warm)
    assert not result.errors, [o.error for o in result.errors]
    assert result.findings == []  # fused cross-entropy's split halves; the constant softmax sink


def test_the_same_masks_without_cp_give_no_finding(warm):
    masked = (("loss_mask", True), ("optimizer_step", False))
    result = audit([Case("gpt", masked, Layout.parse(t)) for t in ("tp2", "dp2")]
                   + [Case("output_loss", (), Layout(tp=2)), Case("moe_router", (), Layout(tp=2, sp=True))],
                   run_pools=warm)
    assert result.findings == [] and not result.errors
