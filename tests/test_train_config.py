"""``shardcheck train --model-config``: functional tests' MODEL_ARGS shrunk into small CPU jobs.

Run on the real configs the repository carries (tests/data/train_configs, and the training
cases of the golden subset tests/data/megatron-golden) and, where the full golden data set
is there, on the real configs of Megatron's functional tests (dense, MoE and CP cases);
without it those are skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_metadata import NO_MEGATRON_TRAINING

if NO_MEGATRON_TRAINING:
    pytest.skip(NO_MEGATRON_TRAINING, allow_module_level=True)

from golden_data import full_data_root, head  # noqa: E402

from shardcheck.megatron.train.args import TrainInputError, plan_runs  # noqa: E402
from shardcheck.megatron.train.config import MAX_RANKS, flags_from_model_config  # noqa: E402

CARRIED = Path(__file__).parent / "data" / "train_configs"
CARRIED_NAMES = ["gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic", "gpt3_mcore_reruns_disable",
                 "gpt3_mcore_te_tp2_pp2_cp2"]
# the training cases of the carried golden subset that run on a CPU (the top-2 router case
# uses Megatron-FSDP, refused below; the hybrid inference case is not a training job)
GOLDEN_SUBSET = ["gpt/gpt3_mcore_tp1_pp2_fp16", "moe/gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4",
                 "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer",
                 "hybrid/hybrid_mr_mcore_te_tp1_pp1_cp1_dgx_a100_1N8G"]
FSDP = "moe/gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router"
REAL = ["gpt/gpt3_mcore_te_tp2_pp2_cp2", "gpt/gpt3_mcore_te_tp2_pp1_cp2_nondeterministic",
        "gpt/gpt3_mcore_reruns_disable", "moe/gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic",
        "moe/gpt3_mcore_te_tp2_pp1_frozen_resume_torch_dist_te_8experts2parallel_dist_optimizer"]


def _value(flags: list[str], flag: str) -> str | None:
    return flags[flags.index(flag) + 1] if flag in flags else None


def _shrunk(tmp_path: Path, model_args: dict[str, str]):
    """``flags_from_model_config`` of a config with these MODEL_ARGS."""
    config = tmp_path / "model_config.yaml"
    config.write_text("MODEL_ARGS:\n" + "".join(f"  {flag}: {value}\n" for flag, value in model_args.items()))
    return flags_from_model_config(config)


def _te_installed() -> bool:
    from shardcheck.megatron.cpu.te import te_dir

    return (te_dir() / "transformer_engine").is_dir()


def _carried_configs() -> list[Path]:
    return sorted(CARRIED.glob("*.yaml")) + [head(f"{name}/model_config.yaml") for name in GOLDEN_SUBSET]


def test_the_carried_configs_are_all_here():
    assert [p.stem for p in sorted(CARRIED.glob("*.yaml"))] == CARRIED_NAMES
    assert all(p.is_file() for p in _carried_configs()) and len(_carried_configs()) == 7


def _shrinks_into_a_runnable_cpu_plan(path: Path) -> None:
    from shardcheck.golden.config import load_model_config

    original = load_model_config(path).model_args
    shrunk = flags_from_model_config(path)
    assert 1 < shrunk.nproc <= MAX_RANKS
    assert _value(shrunk.flags, "--hidden-size") == "64" and _value(shrunk.flags, "--seq-length") == "64"
    for flag in ("--sequence-parallel", "--swiglu", "--untie-embeddings-and-output-weights",
                 "--moe-router-load-balancing-type", "--normalization", "--position-embedding-type",
                 "--group-query-attention", "--moe-token-dispatcher-type"):
        if original.get(flag, "false") != "false":
            assert flag in shrunk.flags, f"{flag} picks a code path and must be kept"
    if "--num-experts" in original:
        assert int(_value(shrunk.flags, "--num-experts")) <= int(original["--num-experts"])
    flags = shrunk.flags
    if (_value(flags, "--transformer-impl") == "transformer_engine" and _te_installed()
            and int(_value(flags, "--context-parallel-size") or 1) > 1 and "--bf16" not in flags):
        # Transformer Engine has no fp32 context-parallel attention: refused in one line, runnable on local layers
        with pytest.raises(TrainInputError, match=r"^--context-parallel-size \d with --transformer-impl "
                           r"transformer_engine in float32: "):
            plan_runs(flags, shrunk.nproc, 2)
        flags = [*flags, "--transformer-impl", "local"]  # as after `--`, which overrides the config
    plan = plan_runs(flags, shrunk.nproc, 2)  # every flag is Megatron's, none refused
    assert plan.world == shrunk.nproc
    assert any("--hidden-size" in line for line in shrunk.mapping)


@pytest.mark.parametrize("path", _carried_configs(),
                         ids=lambda p: p.parent.name if p.name == "model_config.yaml" else p.stem)
def test_a_carried_functional_test_config_shrinks_into_a_runnable_cpu_plan(path):
    _shrinks_into_a_runnable_cpu_plan(path)


@pytest.mark.parametrize("name", REAL, ids=lambda name: name.split("/")[1])
def test_a_real_functional_test_config_shrinks_into_a_runnable_cpu_plan(name):
    path = full_data_root() / "head" / name / "model_config.yaml"
    assert path.is_file(), f"{name} is not in the full golden data set"
    _shrinks_into_a_runnable_cpu_plan(path)


def test_a_config_that_needs_megatron_fsdp_is_refused_with_the_reason():
    shrunk = flags_from_model_config(head(f"{FSDP}/model_config.yaml"))
    with pytest.raises(TrainInputError, match="--use-megatron-fsdp cannot run on a CPU"):
        plan_runs(shrunk.flags, shrunk.nproc, 2)


def test_the_carried_copies_are_the_real_configs():
    root = full_data_root() / "head"
    for carried in sorted(CARRIED.glob("*.yaml")):
        [real] = [p for group in ("gpt", "moe") if (p := root / group / carried.stem / "model_config.yaml").exists()]
        assert real.read_text() == carried.read_text(), carried.name


def test_parallel_sizes_shrink_to_at_most_eight_ranks(tmp_path):
    config = tmp_path / "model_config.yaml"
    config.write_text("MODEL_ARGS:\n  --num-layers: 8\n  --hidden-size: 1024\n  --num-attention-heads: 16\n"
                      "  --tensor-model-parallel-size: 8\n  --pipeline-model-parallel-size: 4\n"
                      "  --seq-length: 2048\n  --max-position-embeddings: 2048\n  --micro-batch-size: 2\n")
    shrunk = flags_from_model_config(config)
    tp, pp = int(_value(shrunk.flags, "--tensor-model-parallel-size")), int(
        _value(shrunk.flags, "--pipeline-model-parallel-size"))
    assert tp * pp <= MAX_RANKS // 2 and shrunk.nproc <= MAX_RANKS
    assert any(line.startswith("--tensor-model-parallel-size 8 ->") for line in shrunk.mapping)


@pytest.mark.parametrize("provider,refused", [("llava_vlm", True), ("hybrid", False)])
def test_a_config_whose_script_builds_another_model_is_refused_not_trained_as_a_gpt(tmp_path, provider, refused):
    """Megatron-LM's MIMO configs pick their model with their script's ``--model-provider``."""
    args = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4",
            "--model-provider": provider, "--tensor-model-parallel-size": "2"}
    if refused:
        with pytest.raises(TrainInputError, match=rf"^--model-provider {provider}: the config's entry script "
                           r"builds that model .*give their entry script with --entry$"):
            _shrunk(tmp_path, args)
    else:
        assert "--model-provider left out: not a flag of this megatron-core" in _shrunk(tmp_path, args).mapping


@pytest.mark.parametrize("levels", ["2 2", '"[2 2]"'])  # as Megatron's functional tests write them
def test_hierarchical_context_parallelism_keeps_its_levels_and_the_one_rank_run_drops_them(tmp_path, levels):
    """A cp4 a2a+p2p job (levels 2 x 2): the pipeline shrinks first; the one-rank run has no CP to split."""
    shrunk = _shrunk(tmp_path, {"--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4",
                                "--pipeline-model-parallel-size": "2", "--context-parallel-size": "4",
                                "--cp-comm-type": "a2a+p2p", "--hierarchical-context-parallel-sizes": levels})
    assert _value(shrunk.flags, "--context-parallel-size") == "4"
    assert _value(shrunk.flags, "--pipeline-model-parallel-size") == "1"
    assert shrunk.flags[shrunk.flags.index("--hierarchical-context-parallel-sizes") + 1:][:2] == ["2", "2"]
    plan = plan_runs(shrunk.flags, shrunk.nproc, 2)
    assert "--cp-comm-type" in plan.parallel and "--cp-comm-type" not in plan.reference
    assert "--hierarchical-context-parallel-sizes" not in plan.reference


def test_with_tp_pp_dp_mapping_expert_tensor_parallelism_shrinks_with_tp_and_cp(tmp_path):
    """Megatron's tp-pp-dp rank order asserts as many data-parallel ranks for experts as for attention."""
    shrunk = _shrunk(tmp_path, {"--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4",
                                "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
                                "--context-parallel-size": "2", "--expert-tensor-parallel-size": "4",
                                "--use-tp-pp-dp-mapping": "true"})
    tp, cp = int(_value(shrunk.flags, "--tensor-model-parallel-size")), int(_value(shrunk.flags, "--context-parallel-size"))
    assert int(_value(shrunk.flags, "--expert-tensor-parallel-size")) == tp * cp < 4
