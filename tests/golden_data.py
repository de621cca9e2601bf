"""Where the real Megatron golden-value data lives (read-only), for the golden tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def data_root() -> Path:
    """$SHARDCHECK_GOLDEN_DATA, else the nearest ancestor's shared/data/megatron-golden."""
    if os.environ.get("SHARDCHECK_GOLDEN_DATA"):
        return Path(os.environ["SHARDCHECK_GOLDEN_DATA"])
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "shared" / "data" / "megatron-golden"
        if candidate.is_dir():
            return candidate
    pytest.skip("real Megatron golden data not found (set SHARDCHECK_GOLDEN_DATA)")


def head(rel: str) -> Path:
    return data_root() / "head" / rel


def history(case: str, subject_start: str) -> tuple[Path, Path]:
    """The version of ``case`` whose commit subject starts with ``subject_start``, and the one before."""
    root = data_root() / "history"
    entries = sorted(
        (e for e in json.loads((root / "index.json").read_text()) if e["case"] == case),
        key=lambda e: e["date"],
    )
    for before, after in zip(entries, entries[1:], strict=False):
        if after["subject"].startswith(subject_start):
            return root / before["file"], root / after["file"]
    raise LookupError(f"{case}: no version with subject {subject_start!r}")


EP8 = "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer"
TOP2 = "moe/gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router"
A2A = "moe/gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4"


def plain_series(path: Path, metric: str) -> dict[int, float]:
    """Finite numeric values of one metric, read with plain json (independent of shardcheck)."""
    values = json.loads(path.read_text())[metric]["values"]
    out = {}
    for step, value in values.items():
        if isinstance(value, int | float) and value == value and abs(value) != float("inf"):
            out[int(step)] = float(value)
    return out
