"""``shardcheck train``: Megatron's own ``pretrain`` on N real Gloo CPU ranks against one rank.

The layouts share one one-rank reference run (module-scoped); each parallel run is compared
with it step by step. A planted bug (the data-parallel gradient all-reduce dropped, in a copy
of megatron-core given with ``--megatron``) must part ways and be named.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from megatron_metadata import NO_MEGATRON_TRAINING

if NO_MEGATRON_TRAINING:
    pytest.skip(NO_MEGATRON_TRAINING, allow_module_level=True)

from shardcheck.cli import main
from shardcheck.cli.train import Launch, run_training, start_from
from shardcheck.golden import load_golden
from shardcheck.megatron.train.args import plan_runs
from shardcheck.train import compare_runs, write_golden

pytestmark = pytest.mark.timeout(900)

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--lr", "1e-3", "--vocab-size", "1024", "--seed", "1234"]
MOE_WITH_BIASES = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall"]
MOE = [*MOE_WITH_BIASES, "--disable-bias-linear"]  # megatron-core's expert bias bug: see below
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2": (2, []),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}
STEPS = 3
LAUNCH = Launch(cpu=True, megatron=None, entry=None, timeout=600)


def _runs(extra: list[str], nproc: int, init: Path):
    plan = plan_runs(BASE + extra, nproc, STEPS)
    start = start_from(init) if plan.same_init else []
    return plan, run_training(plan.parallel + start, nproc, LAUNCH, f"{nproc}-rank run")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The one-rank run all dense layouts compare with, and its saved initial weights."""
    init = tmp_path_factory.mktemp("init")
    plan = plan_runs(BASE, 1, STEPS)
    return run_training(plan.reference, 1, LAUNCH, "one-rank run", save_init=init), init


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_correct_layout_agrees_with_one_rank_at_every_step(layout, dense):
    dense_reference, init = dense
    nproc, extra = LAYOUTS[layout]
    plan, run = _runs(extra, nproc, init)
    assert plan.same_init == (layout == "pp2")
    assert plan_runs(BASE, 1, STEPS).reference == plan.reference  # the shared reference is this one's
    verdict = compare_runs(run, dense_reference)
    assert verdict.agree, verdict.lines()
    assert len(run.steps) == STEPS and verdict.steps == STEPS
    assert set(dense_reference.steps[0].param_norms) <= set(run.steps[0].param_norms)
    # the model check passed on every rank; a pipeline stage's layers are merged with the other's
    assert run.layers == dense_reference.layers == {0: "SelfAttention + MLP", 1: "SelfAttention + MLP"}


def _sized(flags: list[str], **values: str) -> list[str]:
    """``flags`` with the values of some of its flags replaced (``seq_length="64"``: --seq-length 64)."""
    out = list(flags)
    for name, value in values.items():
        out[out.index("--" + name.replace("_", "-")) + 1] = value
    return out


# the README's job (section 7): 64-token sequences, 2 a micro-batch, where the CP halves of a
# sequence hold different numbers of tokens after EOD masking
EOD_JOB = [*_sized(BASE, seq_length="64", max_position_embeddings="64", micro_batch_size="2"),
           *LAYOUTS["cp2"][1], "--eod-mask-loss"]


def test_context_parallel_with_eod_masking_agrees_with_one_rank_when_the_loss_is_per_token():
    """With --calculate-per-token-loss the README's job agrees. Without it each CP rank divides
    its loss by its own count of unmasked tokens before the gradients are averaged over CP, and
    step 1's gradient parts ways: docs/train.md's checked transcript of that job (exit status
    1, the first metric and parameter to part ways, DIFFER) is that test. (CP2 without EOD
    masking agrees: test_correct_layout_agrees_with_one_rank_at_every_step[cp2].)"""
    result = CliRunner().invoke(main, ["train", "-n", "2", "--steps", "1", "--", *EOD_JOB,
                                       "--calculate-per-token-loss"])
    lines = result.output.splitlines()
    assert (result.exit_code, lines[-1]) == (0, "verdict: AGREE"), result.output
    assert not any(ln.startswith("first ") for ln in lines)


def test_torch_fsdp2_agrees_with_one_rank_parameter_by_parameter():
    """Megatron's torch FSDP2 wrapper on Gloo (its device mesh on the CPU, no NCCL options, no
    CUDA_DEVICE_MAX_CONNECTIONS): each rank holds a share of each gradient, and the per-parameter
    norms add the shares (they read one share, a quarter off, before)."""
    result = CliRunner().invoke(main, ["train", "-n", "2", "--steps", "2", "--", *BASE, "--use-torch-fsdp2",
                                       "--untie-embeddings-and-output-weights"])
    lines = result.output.splitlines()
    assert (result.exit_code, lines[-1]) == (0, "verdict: AGREE"), result.output
    assert not any(line.startswith("note: per-parameter gradient norms not compared") for line in lines)


def test_moe_with_expert_parallelism_agrees_and_counts_tokens_per_expert(tmp_path):
    plan = plan_runs(BASE + MOE + ["--expert-model-parallel-size", "2"], 2, STEPS)
    reference = run_training(plan.reference, 1, LAUNCH, "one-rank run", save_init=tmp_path)
    run = run_training(plan.parallel + start_from(tmp_path), 2, LAUNCH, "2-rank run")
    verdict = compare_runs(run, reference)
    assert verdict.agree, verdict.lines()
    for mine, ref in zip(run.steps, reference.steps, strict=True):
        assert mine.tokens_per_expert == ref.tokens_per_expert
        # every token goes to topk=2 experts, in each of the 2 layers: 4 sequences of 32 tokens
        assert {layer: sum(c) for layer, c in ref.tokens_per_expert.items()} == {
            f"decoder.layers.{i}.mlp.router": 4 * 32 * 2 for i in range(2)}
    # expert names are global: both experts of rank 1 appear under their global index
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in run.steps[0].param_norms
    assert run.layers == reference.layers == {i: "SelfAttention + MoELayer (4 experts)" for i in range(2)}


def test_moe_with_biases_stops_at_megatron_cores_expert_bias_bug_in_one_line():
    """megatron-core's expert MLP adds its bias in place to a view that autograd refuses to
    modify, on a layout without expert or tensor parallelism: the one-rank run."""
    result = CliRunner().invoke(main, ["train", "-n", "2", "--steps", "1", "--", *BASE, *MOE_WITH_BIASES,
                                       "--expert-model-parallel-size", "2"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert line.startswith("Error: one-rank run: rank 0 failed (exit code 1): megatron-core bug: ")
    assert "pass --disable-bias-linear" in line
    assert re.search(r" \(at megatron/core/transformer/mlp\.py:\d+\)$", line), line
    assert "Traceback" not in result.output


DROPPED_ALL_REDUCE = ("""                    torch.distributed.all_reduce(
                        bucket.grad_data, op=reduce_op, group=communication_group, async_op=async_op
                    )""", "                    pass  # planted: the data-parallel gradient all-reduce dropped")


def _megatron_copy(tmp_path: Path, module: str = "distributed/param_and_grad_buffer.py",
                   plant: tuple[str, str] = DROPPED_ALL_REDUCE) -> Path:
    """A copy of the installed megatron-core with ``plant`` (old text, new text) in megatron/core/``module``."""
    import megatron.core

    installed = Path(megatron.core.__file__).parent.parent
    copy = tmp_path / "mcore"
    shutil.copytree(installed, copy / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    source = copy / "megatron" / "core" / module
    text = source.read_text()
    assert plant[0] in text
    source.write_text(text.replace(*plant))
    return copy


def test_dropped_gradient_all_reduce_in_a_megatron_copy_exits_1_naming_step_metric_parameter_and_checker_line(
        tmp_path):
    """One checked run: the numbers name the step, metric and parameter, the checker the gradient.
    (A correct TP2 run prints no checker line: docs/train.md's checked transcript of it.)"""
    copy = _megatron_copy(tmp_path)
    result = CliRunner().invoke(main, ["train", "-n", "2", "--typecheck", "--megatron", str(copy), "--out",
                                       str(tmp_path / "golden"), "--", *BASE])
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    first_metric = next(ln for ln in lines if ln.startswith("first metric to part ways"))
    assert "step 1, grad norm" in first_metric  # the loss of step 1 is computed before any update
    first_param = next(ln for ln in lines if ln.startswith("first parameter to part ways"))
    assert first_param.startswith("first parameter to part ways: step 1, gradient norm of ")
    assert "verdict: DIFFER" in lines
    assert any(re.fullmatch(r"checker: unreduced gradient at megatron/core/optimizer/optimizer\.py:\d+ "
                            r"in optimizer\.step: module\.decoder\.final_layernorm\.bias: parameter R "
                            r"on dp, gradient V  \[ranks 0, 1\]", ln) for ln in lines), lines
    # both runs were written in golden form and read back by the golden reader
    for name in ("golden_values_2ranks.json", "golden_values_1rank.json"):
        golden = load_golden(tmp_path / "golden" / name)
        assert {"lm loss", "grad norm", "num-zeros"} <= set(golden.metrics)


def test_golden_form_reads_back_with_the_recorded_values(dense, tmp_path):
    dense_reference, _ = dense
    path = write_golden(dense_reference, tmp_path / "run.json")
    golden = load_golden(path)
    loss = golden.metrics["lm loss"]
    assert list(loss.steps) == [1, 2, 3]
    assert list(loss.values) == [s.metrics["lm loss"] for s in dense_reference.steps]


# --resume-at: tests/test_train_numzeros.py (the num-zeros report's MoE job with the distributed
# optimizer, repeats and --out; a resumed step after the first one, which checks the optimizer's state)
