"""``shardcheck train`` pieces that need no training run: merging rank records, the per-step
verdict, golden form, the flag plan, bad input, and the CPU layer's switch."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from megatron_metadata import NO_MEGATRON_TRAINING

if NO_MEGATRON_TRAINING:
    pytest.skip(NO_MEGATRON_TRAINING, allow_module_level=True)

from shardcheck.cli import main
from shardcheck.golden.config import load_model_config
from shardcheck.golden.io import parse_golden
from shardcheck.golden.resume import resume_step_from_config
from shardcheck.megatron.train.args import TrainInputError, plan_runs
from shardcheck.train import (
    Step,
    Tolerance,
    compare_runs,
    golden_document,
    merge_ranks,
    write_model_config,
)
from shardcheck.train.records import Run

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1"]


def _rank(rank, tp, params, token_shard=(0, 0, 0), last=True, tokens=None, loss=2.0, norm=1.0):
    step = {"step": 1, "loss": {"lm loss": loss}, "grad_norm": norm, "num_zeros": 0.0, "last_stage": last,
            "params": params, "tokens": tokens or {}}
    return {"rank": rank, "tp": tp, "token_shard": list(token_shard), "steps": [step]}


def test_merge_adds_tensor_parallel_shards_once_and_drops_replicas():
    ranks = [_rank(0, 0, {"w": ["tp0", 9.0], "b": ["", 4.0]}, token_shard=(0, 0, 0)),
             _rank(1, 1, {"w": ["tp1", 16.0], "b": ["", 4.0]}, token_shard=(0, 0, 0)),
             _rank(2, 0, {"w": ["tp0", 9.0], "b": ["", 4.0]}, token_shard=(1, 0, 0)),  # a dp replica
             _rank(3, 1, {"w": ["tp1", 16.0], "b": ["", 4.0]}, token_shard=(1, 0, 0))]
    run = merge_ranks(ranks)
    assert run.steps[0].param_norms == {"b": 2.0, "w": 5.0}


def test_merge_adds_tokens_of_distinct_token_shards_only():
    counts = {"router": [3, 1]}
    ranks = [_rank(0, 0, {}, (0, 0, 0), tokens=counts), _rank(1, 1, {}, (0, 0, 0), tokens=counts),
             _rank(2, 0, {}, (1, 0, 0), tokens={"router": [0, 4]})]
    assert merge_ranks(ranks).steps[0].tokens_per_expert == {"router": [3, 5]}


def test_merge_takes_the_metrics_of_the_last_pipeline_stage():
    ranks = [_rank(0, 0, {}, last=False, loss=float("nan")), _rank(1, 0, {}, last=True, loss=3.5)]
    assert merge_ranks(ranks).steps[0].metrics["lm loss"] == 3.5


def _run(losses, norms, params=None, zeros=None):
    return Run([Step(i + 1, {"lm loss": loss, "grad norm": norm, "num-zeros": (zeros or {}).get(i + 1, 0.0)},
                     dict((params or {}).get(i + 1, {})))
                for i, (loss, norm) in enumerate(zip(losses, norms, strict=True))])


def test_verdict_agrees_within_tolerance_and_names_the_first_step_and_metric_that_part():
    ref = _run([2.0, 1.9, 1.8], [1.0, 0.9, 0.8])
    close = _run([2.0 * (1 + 1e-7), 1.9, 1.8], [1.0, 0.9 * (1 - 1e-7), 0.8])
    assert compare_runs(close, ref).agree and not compare_runs(close, ref).exact
    assert compare_runs(ref, ref).exact  # a resumed CPU run's promise: bit for bit
    off = _run([2.0, 1.9, 1.8 * 1.01], [1.0, 0.9 * 1.01, 0.8])
    verdict = compare_runs(off, ref)
    assert not verdict.agree
    assert (verdict.metric.step, verdict.metric.name) == (2, "grad norm")
    assert verdict.lines()[-1] == "verdict: DIFFER"


def test_verdict_names_the_first_parameter_and_ignores_rounding_sized_norms():
    params = {1: {"a": 0.5, "zero_by_construction": 1e-9}}
    ref = _run([2.0], [1.0], params)
    rounding = _run([2.0], [1.0], {1: {"a": 0.5, "zero_by_construction": 3e-9}})
    assert compare_runs(rounding, ref).agree
    wrong = _run([2.0], [1.0], {1: {"a": 0.25, "zero_by_construction": 1e-9}})
    verdict = compare_runs(wrong, ref)
    assert verdict.parameter.name == "gradient norm of a" and verdict.parameter.step == 1


def test_num_zeros_difference_is_explained_by_rounding_zero_gradients_not_a_failure():
    ref = _run([2.0], [1.0], {1: {"a": 0.5, "qkv.bias": 0.0}}, zeros={1: 8.0})
    mine = _run([2.0], [1.0], {1: {"a": 0.5, "qkv.bias": 2e-9}}, zeros={1: 3.0})
    verdict = compare_runs(mine, ref)
    assert verdict.agree
    assert verdict.zero_notes == ["step 1: num-zeros 3 vs one rank 8; rounding in gradients that are "
                                  "zero by construction: qkv.bias"]


def test_tolerance_grows_with_the_step():
    tol = Tolerance(rtol=1e-6, growth=1.0)
    assert tol.at(1, tol.rtol) == 1e-6 and tol.at(3, tol.rtol) == 3e-6


def test_golden_document_is_read_by_the_golden_reader_with_nan_for_missing_values():
    run = _run([2.0, 1.5], [1.0, 0.5])
    run.steps[1].metrics["num-zeros"] = None
    import json

    golden = parse_golden(json.dumps(golden_document(run)), "run")
    assert list(golden.metrics["lm loss"].values) == [2.0, 1.5]
    assert math.isnan(golden.metrics["num-zeros"].values[1])


def test_plan_reports_each_change_and_keeps_the_code_path_flags():
    plan = plan_runs([*SMALL, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--eod-mask-loss",
                      "--hidden-dropout", "0.1", "--vocab-size", "1100", "--bf16"], 4, 5)
    assert plan.sizes["dp"] == 2
    assert "--sequence-parallel" in plan.parallel and "--sequence-parallel" not in plan.reference
    assert "--eod-mask-loss" in plan.parallel and "--eod-mask-loss" in plan.reference
    assert "--tensor-model-parallel-size" not in plan.reference
    assert plan.parallel[plan.parallel.index("--train-iters") + 1] == "5"
    changes = "\n".join(plan.changes)
    assert "--hidden-dropout 0.1 -> 0.0" in changes and "--bf16 dropped" in changes
    assert "--make-vocab-size-divisible-by 256" in changes  # 1100 pads to 1280 under tp2, 1152 alone
    assert plan.reference[plan.reference.index("--global-batch-size") + 1] == "2"


@pytest.mark.parametrize(("args", "message"), [
    (["--no-such-flag"], "unknown Megatron flag --no-such-flag"),
    (["--fp8-format", "hybrid"], "--fp8-format cannot run on a CPU"),
    (["--tensor-model-parallel-size", "3"], "-n 2 is not a multiple of tp*pp*cp = 3"),
])
def test_bad_flags_are_one_line_exit_2(args, message):
    result = CliRunner().invoke(main, ["train", "-n", "2", "--", *SMALL, *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    with pytest.raises(TrainInputError):
        plan_runs([*SMALL, *args], 2, None)


def test_the_cpu_layer_is_one_switch_off_by_default():
    """Without SHARDCHECK_TRAIN_CPU the entry point applies no CPU patch (the GPU path)."""
    code = ("import os; os.environ.pop('SHARDCHECK_TRAIN_CPU', None)\n"
            "import shardcheck.megatron.train.entry as e, shardcheck.megatron.train.cpu as c\n"
            "import shardcheck.megatron.cpu.patches as m\n"
            "e._pretrain = lambda: None\n"
            "e.main()\n"
            "print(c.cpu_layer_active(), m.cpu_patches_active(), c.applied_patches())\n")
    env = {k: v for k, v in os.environ.items() if k != "SHARDCHECK_TRAIN_CPU"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    active, model_patches, applied = out.stdout.strip().split(" ", 2)
    assert (active, model_patches) == ("False", "False")
    assert "cpu" not in applied and "device_count" not in applied


def test_num_zeros_difference_names_the_experts_that_received_no_tokens():
    ref = _run([2.0], [1.0], {1: {"a": 0.5}}, zeros={1: 0.0})
    mine = _run([2.0], [1.0], {1: {"a": 0.5}}, zeros={1: 96.0})
    ref.steps[0].tokens_per_expert = {"decoder.layers.0.mlp.router": [3, 2, 1, 2]}
    mine.steps[0].tokens_per_expert = {"decoder.layers.0.mlp.router": [4, 2, 0, 2]}
    note = compare_runs(mine, ref).zero_notes[0]
    assert "experts with no tokens in one run only" in note and "decoder.layers.0.mlp.router expert 2" in note


def test_zeros_that_moved_are_named_and_called_rounding_when_the_other_run_has_rounding_sized_entries():
    ref = _run([2.0], [1.0], {1: {"qkv.bias": 0.3, "fc.weight": 0.4}}, zeros={1: 0.0})
    mine = _run([2.0], [1.0], {1: {"qkv.bias": 0.3, "fc.weight": 0.4}}, zeros={1: 9.0})
    ref.steps[0].param_zeros = {"qkv.bias": (0, 16), "fc.weight": (0, 0)}
    mine.steps[0].param_zeros = {"qkv.bias": (9, 16), "fc.weight": (0, 0)}
    assert "exact zeros moved in qkv.bias (9 vs 0, rounding zeros)" in compare_runs(mine, ref).zero_notes[0]
    mine.steps[0].param_zeros = {"qkv.bias": (0, 16), "fc.weight": (5, 5)}
    note = compare_runs(mine, ref).zero_notes[0]
    assert "fc.weight (5 vs 0)" in note and "rounding" not in note.split("fc.weight")[1]


@pytest.mark.timeout(600)
def test_a_rank_that_dies_or_hangs_is_one_line_exit_2_and_leaves_no_process(tmp_path):
    dies = tmp_path / "dies.py"
    dies.write_text("import os\nif int(os.environ['RANK']) == int(os.environ['WORLD_SIZE']) - 1:\n"
                    "    raise RuntimeError('the last rank gives up')\n")
    result = CliRunner().invoke(main, ["train", "-n", "2", "--entry", str(dies), "--", *SMALL])
    assert result.exit_code == 2
    # the one-rank run goes first (the parallel run may start from its weights)
    assert "one-rank run: rank 0 failed (exit code 1): RuntimeError: the last rank gives up" in result.output
    hangs = tmp_path / "hangs.py"
    hangs.write_text(f"import os, time\nopen({str(tmp_path)!r} + '/pid' + os.environ['RANK'], 'w')"
                     ".write(str(os.getpid()))\ntime.sleep(1000)\n")
    result = CliRunner().invoke(main, ["train", "-n", "2", "--timeout", "10", "--entry", str(hangs), "--",
                                       *SMALL])
    assert result.exit_code == 2
    assert "one-rank run: rank 0 hung: killed after 10 s" in result.output
    for pidfile in tmp_path.glob("pid*"):  # the ranks that reached the script before the timeout
        pid = int(pidfile.read_text())
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


def test_the_training_patches_leave_the_numbers_alone():
    """Each training patch only replaces a CUDA or build assumption: the compiled fusions give
    their plain function's bits, the dataset helpers are the prebuilt ones, memory is only read,
    and the distributed optimizer's state dict before any step reads step 0 (it asserted: no
    torch Adam state, no step), after one step the step as before, and once loaded each
    parameter's step is the checkpoint's, its own (megatron-core left a stale one, shared, which
    torch's Adam counts once per parameter); a float32 main parameter
    (a view of the model's) takes the loaded optimizer state (megatron-core's loader copied into
    it with autograd on, which torch refuses)."""
    code = """
from types import SimpleNamespace
import torch
from shardcheck.megatron.train.cpu import apply_training_patches, applied_patches
apply_training_patches()
from megatron.core.fusions import fused_bias_gelu
from megatron.core.datasets import helpers_cpp, utils
from megatron.core.dist_checkpointing.strategies import filesystem_async
torch.manual_seed(0)
bias, y = torch.randn(8), torch.randn(4, 8)
plain = getattr(fused_bias_gelu.bias_gelu, '_torchdynamo_orig_callable', fused_bias_gelu.bias_gelu)
assert torch.equal(fused_bias_gelu.bias_gelu(bias, y), plain(bias, y))
assert utils.compile_helpers() is None and hasattr(helpers_cpp, 'build_sample_idx_int64')
assert filesystem_async._process_memory() > 1 << 20
assert torch.cuda.device_count() == 1 and not torch.cuda.is_available()
from megatron.core import parallel_state
assert parallel_state.get_nccl_options('dp', {'dp': {'is_high_priority_stream': True}}) is None
from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp
import torch.distributed as dist
dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)
assert fsdp.DeviceMesh.from_group(dist.group.WORLD, 'cuda').device_type == 'cpu'
dist.destroy_process_group()
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
adam = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
steps = lambda: [g['step'] for g in DistributedOptimizer.state_dict(
    SimpleNamespace(optimizer=adam, grad_scaler=None))['optimizer']['param_groups']]
assert steps() == [0.0] and not adam.state
adam.param_groups[0]['params'][0].grad = torch.ones(2)
adam.step()
assert steps() == [1.0]
stale = adam.state_dict()  # megatron-core's load: one step tensor for all, then a stale step over it
adam.add_param_group({'params': [torch.nn.Parameter(torch.ones(3))]})
stale['param_groups'].append({**stale['param_groups'][0], 'params': [1]})
stale['state'][1] = {**stale['state'][0]}
stale['state'][0]['step'] = stale['state'][1]['step'] = torch.tensor(0.0)
stale['optimizer'] = {'param_groups': [{'step': 1.0}, {'step': 1.0}]}  # the checkpoint's step
DistributedOptimizer.load_state_dict(SimpleNamespace(optimizer=adam, ddp_config=SimpleNamespace(
    use_megatron_fsdp=True)), stale)  # the early path: the inner optimizer's own load
first, second = (adam.state[group['params'][0]]['step'] for group in adam.param_groups)
assert first is not second and first.item() == second.item() == 1.0
weight = torch.nn.Parameter(torch.zeros(2))  # fp32: the main parameter is a view of it
DistributedOptimizer.load_parameter_state_from_dp_reshardable(SimpleNamespace(
    gbuf_ranges=[{torch.float32: [{'param_map': {weight: None}}]}],
    _set_main_param_and_optimizer_states=lambda param, state: param.view(-1)[:2].copy_(state['param'])),
    {0: {torch.float32: [[{'padding': False, 'param': torch.ones(2)}]]}})
assert weight.tolist() == [1.0, 1.0]
print(' '.join(applied_patches()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["typing_override", "allow_no_cuda", "device_count", "device_arch", "nccl_options",
                           "fsdp_mesh", "dataset_helpers", "eager_fusions", "process_memory", "optimizer_steps",
                           "fp32_optimizer_load", "cpu"]


def test_a_runs_flags_written_as_model_config_read_back_as_its_model_args(tmp_path):
    path = write_model_config([*SMALL, "--num-experts", "8", "--disable-bias-linear", "--lr", "-1e-3"],
                              tmp_path / "model_config.yaml")
    args = load_model_config(path).model_args
    assert args["--hidden-size"] == "64" and args["--num-experts"] == "8"
    assert args["--disable-bias-linear"] == "true"  # a flag without a value
    assert args["--lr"] == "-1e-3"  # a negative value is a value, not a flag


def test_a_resumed_runs_config_is_a_resume_test_and_a_flag_given_twice_is_written_once(tmp_path):
    """--resume-at S: a functional ckpt-resume test's config, whose save interval is where golden
    check --second-run and golden compare split; an override after the config's flags wins."""
    path = write_model_config([*SMALL, "--num-experts", "4", "--num-experts", "8"], tmp_path / "model_config.yaml",
                              resume_at=2)
    config = load_model_config(path)
    assert config.test_type == "ckpt-resume" and resume_step_from_config(config) == 2
    assert config.model_args["--num-experts"] == "8"
    assert path.read_text().count("--num-experts") == 1


def test_half_precision_runs_get_a_tolerance_of_their_epsilon_and_fp32_keeps_its_own():
    assert Tolerance.for_precision("fp32") == Tolerance()
    bf16, fp16 = Tolerance.for_precision("bf16"), Tolerance.for_precision("fp16")
    assert bf16.rtol == 2.0 ** -7 / 4 and bf16.param_rtol == 2.0 ** -7
    assert fp16.rtol < bf16.rtol and Tolerance().rtol < fp16.rtol
