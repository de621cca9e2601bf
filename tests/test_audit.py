"""The audit on real megatron-core: known bugs found with numbers and locations, none on correct layouts."""

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("megatron.core")

from audit_outcomes import worst_relative  # noqa: E402

from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD, pools  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow
for module in PRELOAD:
    __import__(module)

KNOWN = {  # trigger, location, checker line (None: numeric-only)
    "label smoothing": (Case("output_loss", (("label_smoothing", 0.1),), Layout(tp=2)),
                        "tensor_parallel/cross_entropy.py",
                        "checker: mean over shard at megatron/core/tensor_parallel/cross_entropy.py:"),
    "cp loss": (Case("gpt", (("loss_mask", True), ("optimizer_step", False)), Layout(cp=2)),
                "pipeline_parallel/schedules.py",
                "checker: non-linear on partial at megatron/core/pipeline_parallel/schedules.py:"),
    "router count": (Case("moe_router", (("padding", True),), Layout(tp=2, sp=True)),
                     "transformer/moe/moe_utils.py",
                     "checker: contract at megatron/core/transformer/moe/router.py:"),
}
CORRECT = ["tp2", "tp2-sp", "dp2", "pp2", "cp2", "tp2-dp2-sp", "cp2-dp2", "tp2-pp2", "tp2-cp2",
           "cp2-pp2"]
RIGHT_OPTIONS = [(("cross_entropy_loss_fusion", True),), (("softmax_type", "off-by-one"),)]


@pytest.fixture(scope="module")
def known(audit_pools):
    return audit([case for case, _, _ in KNOWN.values()], run_pools=audit_pools)


@pytest.mark.release_specific
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
    assert finding.control is not None and finding.control["equal_to_reference"], finding.control
    assert finding.reproduce.startswith(f"shardcheck audit --only {case.component} --layouts {case.layout}")
    assert "ensures" in finding.contract or "requires" in finding.contract


def test_known_bugs_are_three_distinct_findings(known):
    assert len(known.findings) == 3 and len({f.id for f in known.findings}) == 3


@pytest.mark.parametrize("precision", [(), (("bf16", True),), (("fp16", True),)], ids=["fp32", "bf16", "fp16"])
def test_plain_gpt_on_correct_layouts_gives_no_finding(audit_pools, precision):
    """In 16 bits through Megatron's Float16Module and mixed-precision optimizer (fp32 main
    grads, fp16's loss scaler), at the tolerance of the precision."""
    result = audit([Case("gpt", precision, Layout.parse(text)) for text in CORRECT], run_pools=audit_pools)
    assert not result.errors, [o.error for o in result.errors]
    assert not result.not_swept, result.not_swept  # the 16-bit option runs on one rank
    assert len(result.outcomes) == len(CORRECT)
    assert result.findings == []  # type-only included: CP's per-rank count of an all-ones mask
    if not precision:  # fp32: as close to one rank as sums in another order allow
        reference = audit_pools.references[("gpt", (), 0)].outputs
        assert float(reference["clip_factor"]) < 1.0  # the step really clips
        for outcome in result.outcomes:
            assert worst_relative(outcome, reference, "grad/") < 1e-5, outcome.case.layout
            assert worst_relative(outcome, reference, "param/") < 1e-4, outcome.case.layout
            for name in ("loss", "grad_norm", "clip_factor"):
                assert worst_relative(outcome, reference, name) < 1e-6, (outcome.case.layout, name)


def test_a_bug_still_shows_in_bf16(audit_pools):
    """The CP loss bug (loss mask under cp2) shows above bf16's rounding, in the gradients
    (the loss itself moves by 2e-4 relative, under bf16's tolerance)."""
    masked = (("loss_mask", True), ("optimizer_step", False), ("bf16", True))
    result = audit([Case("gpt", masked, Layout(cp=2))], run_pools=audit_pools)
    [finding] = [f for f in result.findings if f.kind != "type-only"]
    assert finding.effect[0]["value"].startswith("grad/")
    assert finding.effect[0]["max_rel_error"] > 6 * torch.finfo(torch.bfloat16).eps


def test_options_megatron_gets_right_under_tp_give_no_finding(audit_pools):
    result = audit([Case("gpt", options, Layout(tp=2)) for options in RIGHT_OPTIONS], run_pools=audit_pools)
    assert not result.errors, [o.error for o in result.errors]
    assert len(result.outcomes) == len(RIGHT_OPTIONS) and not result.not_swept  # every case ran
    assert result.findings == []  # fused cross-entropy's split halves; the constant softmax sink


def test_the_same_masks_without_cp_give_no_finding(audit_pools):
    masked = (("loss_mask", True), ("optimizer_step", False))
    result = audit([Case("gpt", masked, Layout.parse(t)) for t in ("tp2", "dp2")]
                   + [Case("output_loss", (), Layout(tp=2)), Case("moe_router", (), Layout(tp=2, sp=True))],
                   run_pools=audit_pools)
    assert len(result.outcomes) == 4 and not result.not_swept and not result.not_applicable  # all ran
    assert result.findings == [] and not result.errors


def test_layouts_a_component_does_not_support_are_listed_apart_from_errors(audit_pools):
    cases = [Case("gpt", (), Layout(dp=2, ep=2)),                # no experts: refused before running
             Case("moe_router", (), Layout(tp=2)),               # Megatron refuses MoE with tp, no sp
             Case("moe_router", (("padding", True),), Layout(tp=2))]  # same layout: not run again
    result = audit(cases, run_pools=audit_pools)
    assert result.outcomes == [] and not result.errors
    assert result.not_applicable == [
        "gpt @ dp2-ep2: expert parallelism needs a component with experts",
        "moe_router @ tp2: MoE with tp > 1 needs sequence parallelism (Megatron refuses it)"]


def test_a_layout_a_scenario_refuses_on_its_ranks_is_not_an_error():
    from shardcheck.megatron.audit.outcome import Outcome
    from shardcheck.megatron.audit.schedule import Swept, record

    swept, case = Swept(), Case("gpt", (), Layout(tp=2))
    record(swept, Outcome(case, error="shardcheck.megatron.cpu.parallel.LayoutUnsupported: no such groups"))
    record(swept, Outcome(Case("gpt", (), Layout(dp=2)), error="RuntimeError: boom"))
    assert swept.not_applicable == {("gpt", "tp2"): "gpt @ tp2: no such groups"}
    assert [o.case.layout for o in swept.outcomes] == [Layout(dp=2)] and swept.broken == {("gpt", "dp2")}


def test_an_option_inert_at_one_rank_is_swept_before_the_plan_moves_to_larger_layouts(audit_pools):
    gathered, smoothing = (("parallel_output", False),), (("label_smoothing", 0.1),)
    cases = [Case("output_loss", gathered, Layout(tp=2)),          # inert at one rank: waits
             Case("output_loss", smoothing, Layout(tp=2, dp=2)),   # 4 ranks: the 2-rank tier ends
             Case("output_loss", gathered, Layout(tp=2, dp=2))]    # waits until the plan ends
    result = audit(cases, run_pools=audit_pools)
    ran = [(o.case.options, o.case.layout.world_size) for o in result.outcomes]
    assert ran == [(gathered, 2), (smoothing, 4), (gathered, 4)], result.not_swept
    # full-vocabulary logits fed to the vocab-parallel loss: wrong under tp, like label smoothing
    assert all(o.gaps for o in result.outcomes)


def test_a_warm_rank_starts_each_case_with_fresh_moe_state(audit_pools):
    """The schedules set the aux-loss gradient scale (1 / microbatches) process-wide; a router
    case run next in the same rank must not inherit it."""
    from shardcheck.megatron.audit.rank import run_case
    from shardcheck.megatron.cpu.runner import run_layout
    from shardcheck.megatron.scenarios import scenario

    audit_pools.run(Layout(), run_case, "moe", (("optimizer_step", False),), (), False)
    [after_gpt] = audit_pools.run(Layout(), run_case, "moe_router", (), (), False)
    fresh = run_layout(scenario("moe_router"), Layout())
    for name, value in fresh.items():
        assert after_gpt.outputs[name].numpy() == pytest.approx(value, rel=1e-6, abs=1e-9), name


@dataclass(frozen=True)
class _NeedsMissingModule:
    """A component whose code this release lacks."""


def _needs_missing_module(ctx, setup):
    import megatron.core.no_such_module_in_this_release  # noqa: F401


def test_a_component_that_cannot_run_on_this_release_is_one_line_and_the_others_run(monkeypatch):
    from shardcheck.megatron import scenarios

    monkeypatch.setitem(scenarios.COMPONENTS, "missing",
                        scenarios.Component(_needs_missing_module, _NeedsMissingModule))
    with pools() as fresh:  # forked after the component is registered
        result = audit([Case("missing", (), Layout(tp=2)), Case("output_loss", (), Layout(tp=2))],
                       run_pools=fresh)
    assert result.unavailable == {"missing": "fails on one rank: ModuleNotFoundError: No module named "
                                             "'megatron.core.no_such_module_in_this_release'"}
    assert [o.case.component for o in result.outcomes] == ["output_loss"] and not result.findings
    assert result.patches["rng"] == "applied"
