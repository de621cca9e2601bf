"""megatron-core's own checks of its arguments (a constructor's divisibility assertion, the
schedule refusing overlapped p2p without interleaving) are configurations it refuses, listed
with their reason, not crash findings; an error deeper in the code stays a crash
(tests/test_audit_crash.py runs one)."""

import json

import pytest

pytest.importorskip("megatron.core")

from shardcheck.megatron.audit import report as audit_report  # noqa: E402
from shardcheck.megatron.audit.outcome import Outcome, _in_config_check  # noqa: E402
from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402
from shardcheck.parity.pool import PoolFailure  # noqa: E402

pytestmark = pytest.mark.slow
DIVIDE = Case("gpt", (("ffn_hidden_size", 1),), Layout.parse("tp2"))
OVERLAP = Case("gpt", (("overlap_p2p_comm", True),), Layout.parse("pp2"))
REFUSES = "megatron-core refuses it"


@pytest.fixture(scope="module")
def result(audit_pools):
    return audit([DIVIDE, OVERLAP], run_pools=audit_pools, typecheck=False)


def _entry(result, case: Case) -> str:
    [entry] = [e for e in result.refused if e.startswith(f"{case.label}: ")]
    return entry


def test_a_constructors_divisibility_check_is_a_refusal_not_a_crash(result):
    assert not result.findings and not result.outcomes  # nothing crashed, nothing to compare
    assert _entry(result, DIVIDE).startswith(
        f"{DIVIDE.label}: {REFUSES}: AssertionError: 1 is not divisible by 2 when instantiating")
    assert _entry(result, DIVIDE).endswith(" in ensure_divisibility)")  # megatron-core's frame


def test_the_schedules_check_of_its_config_is_a_refusal_not_a_crash(result):
    assert _entry(result, OVERLAP).startswith(
        f"{OVERLAP.label}: {REFUSES}: ValueError: Non-interleaved pipeline parallelism does not "
        "support overlapping p2p communication (megatron/core/pipeline_parallel/schedules.py:")
    assert _entry(result, OVERLAP).endswith(" in forward_backward_pipelining_without_interleaving)")


def test_the_report_lists_and_counts_the_refusals_apart_from_the_layouts(result, tmp_path):
    audit_report.write(tmp_path, result.findings, result.summary())
    summary = json.loads((tmp_path / "findings.json").read_text())["summary"]
    assert summary["configurations megatron-core refuses"] == 2 and summary["findings"] == 0
    assert summary["findings megatron.training refuses"] == 0
    assert summary["layouts a component does not support"] == 0
    assert sorted(summary["refused"]) == sorted([_entry(result, DIVIDE), _entry(result, OVERLAP)])
    text = (tmp_path / "report.md").read_text()
    section = text.split("## Configurations megatron-core refuses (2)\n\n", 1)[1].split("\n\n")[0]
    assert sorted(section.splitlines()) == sorted(f"- {e}" for e in summary["refused"])
    assert "## Not applicable" not in text and "## Crashes only a layout causes: one rank runs the same case (0)" in text


def _failure(*frames: str, raised: str) -> PoolFailure:
    lines = "".join(f'  File "/site-packages/megatron/core/{f.split(":")[0]}", line 9, in {f.split(":")[1]}\n    x\n'
                    for f in frames)
    return PoolFailure("error", raised, {0: f"Traceback (most recent call last):\n{lines}{raised}\n"})


@pytest.mark.parametrize(("frames", "raised"), [
    (("models/gpt/gpt_model.py:forward", "transformer/attention.py:forward"), "AssertionError: shapes"),
    (("pipeline_parallel/schedules.py:forward_backward_no_pipelining", "pipeline_parallel/schedules.py:forward_step"),
     "ValueError: mid-step"),
    (("tensor_parallel/layers.py:__init__",), "IndexError: list index out of range"),
    (("transformer/mlp.py:forward", "utils.py:ensure_divisibility"), "AssertionError: 3 is not divisible by 2"),
], ids=["assert-in-forward", "valueerror-below-the-entry", "indexerror-in-init", "check-outside-a-constructor"])
def test_an_error_in_the_middle_of_a_computation_is_no_argument_check(frames, raised):
    assert not _in_config_check(_failure(*frames, raised=raised))


def test_a_check_a_constructor_calls_is_an_argument_check():
    assert _in_config_check(_failure("tensor_parallel/layers.py:__init__", "utils.py:divide",
                                     "utils.py:ensure_divisibility", raised="AssertionError: 1 is not divisible by 2"))


FUSED_ROPE = "AssertionError: fused_single_qkv_rope requested but not available/supported for the config."


@pytest.mark.parametrize(("options", "raised", "refused"), [
    (("fused_single_qkv_rope",), FUSED_ROPE, True),  # a check where the option is read
    (("moe_apply_probs_on_input",), "AssertionError: `moe_apply_probs_on_input` only works with `moe_router_topk`=1.",
     True),
    ((), FUSED_ROPE, False),  # the case did not set it: megatron-core's own state, a crash
    (("fused_single_qkv_rope",), FUSED_ROPE.replace("AssertionError", "RuntimeError"), False),
    (("bias",), "AssertionError: bias of the wrong shape", False),  # a word, not a field's name
], ids=["fused-rope", "probs-on-input", "not-an-option-of-the-case", "runtimeerror", "plain-word"])
def test_an_assertion_naming_an_option_of_the_case_is_its_argument_check(options, raised, refused):
    failure = _failure("models/gpt/gpt_model.py:forward", "transformer/attention.py:forward", raised=raised)
    assert _in_config_check(failure, options) is refused


@pytest.mark.parametrize(("raised", "refused"), [
    ("AssertionError: Attention bias is not supported for DotProductAttention.", True),
    ("ValueError: Packed sequence is not supported by DotProductAttention.Please use TEDotProductAttention instead.",
     True),
    ("AssertionError: the supported position embedding types are rope and none", False),  # words, no refusal
    ("RuntimeError: Attention bias is not supported for DotProductAttention.", False),  # not how a check says no
], ids=["not-supported", "please-use", "supported-types", "runtimeerror"])
def test_megatron_declining_a_combination_in_words_is_a_refusal(raised, refused):
    failure = _failure("models/t5/t5_model.py:forward", "transformer/dot_product_attention.py:forward", raised=raised)
    assert _in_config_check(failure) is refused


def test_megatron_asking_for_a_package_to_be_installed_is_missing_code_not_a_crash():
    error = "ValueError: fused_topk_with_score_function is not available. Please install TE >= 2.6.0."
    outcome = Outcome(Case("moe_router", (("moe_router_fusion", True),), Layout()), error=error,
                      error_kind="error", in_megatron=True)
    assert not outcome.one_rank_crash
    assert Outcome(Case("gpt", (), Layout()), error="RuntimeError: boom", error_kind="error",
                   in_megatron=True).one_rank_crash


def test_a_torch_function_this_build_lacks_is_an_option_that_cannot_run_here_not_a_crash():
    """``use_ring_exchange_p2p`` calls ``torch.distributed.ring_exchange``, which only NVIDIA's
    PyTorch builds have: listed as not swept under its layout, no finding, no error."""
    from shardcheck.megatron.audit.schedule import Swept, record

    case = Case("gpt", (("use_ring_exchange_p2p", True),), Layout.parse("pp2"))
    error = "AttributeError: module 'torch.distributed' has no attribute 'ring_exchange'"
    outcome = Outcome(case, error=error, error_kind="error", reference_digest="r", in_megatron=True,
                      frame="megatron/core/pipeline_parallel/p2p_communication.py:370 in _communicate")
    assert outcome.missing_code and not outcome.crashed
    swept = Swept()
    record(swept, outcome)
    assert not swept.outcomes and not swept.not_applicable
    assert swept.not_swept == {(case.component, case.options): f"this machine lacks code it needs under pp2: {error}"}
    # megatron-core's own attribute error is a crash
    own = Outcome(case, error="AttributeError: 'NoneType' object has no attribute 'size'", error_kind="error")
    assert own.crashed and not own.missing_code


def test_crashes_at_one_place_with_one_message_are_one_cause_whatever_triggers_them():
    """megatron-core's in-place write to gathered logits, reached by each model's own options,
    is one bug; another exception at the same line is another."""
    from shardcheck.megatron.audit.findings import _crash_causes

    view = "RuntimeError: Output 0 of _GatherFromModelParallelRegion is a view and is modified inplace"
    frame = "megatron/core/tensor_parallel/cross_entropy.py:190 in forward"
    triggers = [("gpt", "GPTModel.parallel_output", False), ("gpt", "GPTModel.forward.runtime_gather_output", True),
                ("t5", "T5Model.parallel_output", False)]
    crashes = [Outcome(Case(component, ((name, value),), Layout()), error=view, error_kind="error", frame=frame,
                       in_megatron=True) for component, name, value in triggers]
    other = Outcome(Case("gpt", (("vocab_size", 7),), Layout()), error="RuntimeError: size 7 vs 8",
                    error_kind="error", frame=frame, in_megatron=True)
    causes = _crash_causes([*crashes, other])
    assert sorted(len(cause) for cause in causes) == [1, 3]
    assert [o.case.component for cause in causes if len(cause) == 3 for o in cause].count("t5") == 1
