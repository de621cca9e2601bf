"""``shardcheck train --model-config``: functional tests' MODEL_ARGS shrunk into small CPU jobs.

Run on copies the repository carries (tests/data/train_configs) and, where ../shared is
there, on the real configs of Megatron's functional tests (dense, MoE and CP cases).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest
from packaging.version import Version

if Version(importlib.metadata.version("megatron-core")).release[:2] < (0, 19):  # read, not imported
    pytest.skip("megatron.training ships with megatron-core 0.19 on (0.16.1 has megatron/core only)",
                allow_module_level=True)

from shardcheck.megatron.train.args import plan_runs
from shardcheck.megatron.train.config import MAX_RANKS, flags_from_model_config

CARRIED = Path(__file__).parent / "data" / "train_configs"
REAL = ["gpt/gpt3_mcore_te_tp2_pp2_cp2", "gpt/gpt3_mcore_te_tp2_pp1_cp2_nondeterministic",
        "gpt/gpt3_mcore_reruns_disable", "moe/gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic",
        "moe/gpt3_mcore_te_tp2_pp1_frozen_resume_torch_dist_te_8experts2parallel_dist_optimizer"]


def _value(flags: list[str], flag: str) -> str | None:
    return flags[flags.index(flag) + 1] if flag in flags else None


def _shared_head() -> Path:
    """The real golden data's head/ folder, as tests/golden_data.py finds it (may not exist)."""
    if os.environ.get("SHARDCHECK_GOLDEN_DATA"):
        return Path(os.environ["SHARDCHECK_GOLDEN_DATA"]) / "head"
    for parent in Path(__file__).resolve().parents:
        if (parent / "shared" / "data" / "megatron-golden").is_dir():
            return parent / "shared" / "data" / "megatron-golden" / "head"
    return CARRIED / "absent"


SHARED = _shared_head()


def _configs() -> list[Path]:
    carried = sorted(CARRIED.glob("*.yaml"))
    real = [SHARED / name / "model_config.yaml" for name in REAL]
    return carried + [p for p in real if p.exists()]


@pytest.mark.parametrize("path", _configs(), ids=lambda p: p.parent.name if p.name == "model_config.yaml" else p.stem)
def test_a_functional_test_config_shrinks_into_a_runnable_cpu_plan(path):
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
    plan = plan_runs(shrunk.flags, shrunk.nproc, 2)  # every flag is Megatron's, none refused
    assert plan.world == shrunk.nproc
    assert any("--hidden-size" in line for line in shrunk.mapping)


def test_the_carried_copies_are_the_real_configs_where_both_exist():
    for carried in CARRIED.glob("*.yaml"):
        real = [SHARED / group / carried.stem / "model_config.yaml" for group in ("gpt", "moe")]
        for path in real:
            if path.exists():
                assert path.read_text() == carried.read_text()


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
