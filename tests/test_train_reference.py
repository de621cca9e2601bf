"""``shardcheck train --reference``: the one-rank reference takes the whole global batch in one
micro-batch where the loss is per token (``--calculate-per-token-loss``: independent of the
split), so a bug that normalises each micro-batch by its own token count cannot hide in a
reference that shares the parallel run's split.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from megatron_metadata import NO_MEGATRON_TRAINING

if NO_MEGATRON_TRAINING:
    pytest.skip(NO_MEGATRON_TRAINING, allow_module_level=True)

from test_train import BASE, LAUNCH, LAYOUTS, MOE, _megatron_copy

from shardcheck.cli import main
from shardcheck.cli.train import run_training, start_from
from shardcheck.megatron.train.args import TrainInputError, plan_runs
from shardcheck.train import compare_runs

pytestmark = pytest.mark.timeout(900)

PER_TOKEN = "--calculate-per-token-loss"
# each micro-batch's summed loss divided by its own token count before Megatron divides the
# accumulated gradients by the global token count: the result depends on the split
MICRO_BATCH_NORMALISED = (
    """                output_tensor, num_tokens, loss_reduced = outputs
                if not config.calculate_per_token_loss:""",
    """                output_tensor, num_tokens, loss_reduced = outputs
                if config.calculate_per_token_loss:  # planted: normalised by the micro-batch's own tokens
                    output_tensor = output_tensor / torch.clamp(num_tokens, min=1)
                if not config.calculate_per_token_loss:""")


def _micro(tokens: list[str]) -> str:
    return tokens[tokens.index("--micro-batch-size") + 1]


def _without_micro(tokens: list[str]) -> list[str]:
    at = tokens.index("--micro-batch-size")
    return tokens[:at] + tokens[at + 2:]


@pytest.mark.parametrize(("extra", "reference", "micro", "lines"), [
    ([], None, "1", ["one rank, the global batch of 4 in the same 4 micro-batches of 1 (no "
                     "--calculate-per-token-loss: Megatron's loss is a mean of micro-batch means)"]),
    ([PER_TOKEN], None, "4", ["one rank, the whole global batch of 4 in one micro-batch (--calculate-per-token-"
                              "loss: the loss is summed over tokens and divided by the global token count, so "
                              "the split does not matter)"]),
    ([PER_TOKEN], "same-micro-batches", "1",
     ["one rank, the global batch of 4 in the same 4 micro-batches of 1 (--reference same-micro-batches)"]),
    ([], "whole-batch", "4",
     ["one rank, the whole global batch of 4 in one micro-batch (--reference whole-batch)",
      "without --calculate-per-token-loss Megatron's loss is a mean of micro-batch means, so it depends on "
      "the split: a difference may be that definition, not a bug"]),
    ([PER_TOKEN, "--moe-aux-loss-coeff", "0.01"], None, "1",
     ["one rank, the global batch of 4 in the same 4 micro-batches of 1 (--calculate-per-token-loss: the loss is "
      "summed over tokens and divided by the global token count)",
      "--moe-aux-loss-coeff: Megatron computes this loss per micro-batch, so the split changes it"]),
    ([PER_TOKEN, "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"], "whole-batch", "4",
     ["one rank, the whole global batch of 4 in one micro-batch (--reference whole-batch)",
      "--moe-aux-loss-coeff, --moe-z-loss-coeff: Megatron computes these losses per micro-batch, so the split "
      "changes it: a difference may be that, not a bug"]),
], ids=["default", "default-per-token", "same-per-token", "whole-without-per-token", "default-per-token-aux-loss",
        "whole-with-aux-and-z-loss"])
def test_the_reference_batching_under_each_mode_and_default(extra, reference, micro, lines):
    plan = plan_runs([*BASE, *extra], 2, 1, reference=reference)
    assert (_micro(plan.parallel), _micro(plan.reference)) == ("1", micro)
    assert plan.reference_kind == ("whole-batch" if micro == "4" else "same-micro-batches")
    assert plan.reference_lines == lines
    # only the micro-batch size differs from the reference of the same micro-batches
    same = plan_runs([*BASE, *extra], 2, 1, reference="same-micro-batches").reference
    assert _without_micro(plan.reference) == _without_micro(same)


def test_a_pipeline_job_keeps_its_micro_batches_and_the_reference_takes_one():
    plan = plan_runs([*BASE, PER_TOKEN, *LAYOUTS["pp2"][1]], 2, 1)
    assert (_micro(plan.parallel), _micro(plan.reference)) == ("1", "4")
    assert "--pipeline-model-parallel-size" not in plan.reference


def test_an_unknown_reference_is_clicks_one_line_exit_2():
    result = CliRunner().invoke(main, ["train", "-n", "2", "--reference", "half", "--", *BASE])
    assert result.exit_code == 2
    assert "Invalid value for '--reference'" in result.output and "Traceback" not in result.output
    with pytest.raises(TrainInputError, match="unknown reference 'half'"):
        plan_runs(BASE, 2, 1, reference="half")


def _train(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["train", "-n", "2", *args])
    return result.exit_code, result.output.splitlines()


def test_micro_batch_local_normalisation_is_caught_by_the_whole_batch_reference_only(tmp_path):
    """With the bug each DP2 micro-batch of 32 tokens is divided by 32, the one micro-batch of
    the whole batch by 128: the gradients part ways. A reference of the same micro-batches
    shares the bug's split, and agrees."""
    copy = str(_megatron_copy(tmp_path, "pipeline_parallel/schedules.py", MICRO_BATCH_NORMALISED))
    status, lines = _train("--megatron", copy, "--steps", "1", "--", *BASE, PER_TOKEN)
    assert (status, lines[-1]) == (1, "verdict: DIFFER"), lines
    assert any(ln.startswith("reference: one rank, the whole global batch of 4 in one micro-batch") for ln in lines)
    assert next(ln for ln in lines if ln.startswith("first metric to part ways: ")).startswith(
        "first metric to part ways: step 1, grad norm: ")
    status, lines = _train("--megatron", copy, "--steps", "1", "--reference", "same-micro-batches", "--",
                           *BASE, PER_TOKEN)
    assert (status, lines[-1]) == (0, "verdict: AGREE"), lines
    assert "reference: one rank, the global batch of 4 in the same 4 micro-batches of 1 (--reference " \
           "same-micro-batches)" in lines


STEPS = 2


@pytest.fixture(scope="module")
def whole_batch(tmp_path_factory):
    """The whole-batch one-rank run of the per-token job, and its saved initial weights."""
    init = tmp_path_factory.mktemp("init")
    plan = plan_runs([*BASE, PER_TOKEN], 1, STEPS)
    return plan.reference, run_training(plan.reference, 1, LAUNCH, "one-rank run", save_init=init), init


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_correct_per_token_layout_agrees_with_the_whole_batch_reference_at_every_step(layout, whole_batch):
    flags, reference, init = whole_batch
    nproc, extra = LAYOUTS[layout]
    plan = plan_runs([*BASE, PER_TOKEN, *extra], nproc, STEPS)
    assert plan.reference == flags  # the shared reference is this one's
    run = run_training(plan.parallel + (start_from(init) if plan.same_init else []), nproc, LAUNCH, "2-rank run")
    verdict = compare_runs(run, reference)
    assert verdict.agree and verdict.steps == STEPS, verdict.lines()


def test_the_reference_used_is_printed_and_written_with_out(tmp_path):
    status, lines = _train("--steps", "1", "--out", str(tmp_path), "--", *BASE, PER_TOKEN)
    assert (status, lines[-1]) == (0, "verdict: AGREE"), lines
    (line,) = [ln for ln in lines if ln.startswith("reference: ")]
    assert line.startswith("reference: one rank, the whole global batch of 4 in one micro-batch "
                           "(--calculate-per-token-loss: ")
    assert (tmp_path / "reference.txt").read_text() == line + "\n"


def test_moe_with_expert_parallelism_agrees_with_the_whole_batch_reference():
    """Tokens per expert and the experts' gradients do not depend on the split (no auxiliary
    loss: its coefficient defaults to 0)."""
    status, lines = _train("--steps", str(STEPS), "--", *BASE, *MOE, "--expert-model-parallel-size", "2", PER_TOKEN)
    assert (status, lines[-1]) == (0, "verdict: AGREE"), lines
    assert any(ln.startswith("reference: one rank, the whole global batch of 4 in one micro-batch") for ln in lines)
