"""Real Megatron golden-value data for the golden tests.

The tests read the subset the repository carries (``tests/data/megatron-golden``, see its
README). The few tests that walk every file read the full data set instead, and are
skipped with the reason when it is absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

CARRIED = Path(__file__).resolve().parent / "data" / "megatron-golden"
ENV = "SHARDCHECK_GOLDEN_DATA"


def data_root() -> Path:
    """The carried subset: same layout as the full data set (head/, history/)."""
    return CARRIED


def find_full_data() -> Path | None:
    """$SHARDCHECK_GOLDEN_DATA, else the nearest ancestor's shared/data/megatron-golden."""
    if os.environ.get(ENV):
        root = Path(os.environ[ENV])
        if not (root / "head").is_dir():
            raise FileNotFoundError(f"${ENV}={root} has no head/ folder")
        return root
    for parent in CARRIED.parents:
        candidate = parent / "shared" / "data" / "megatron-golden"
        if candidate.is_dir():
            return candidate
    return None


def full_data_root() -> Path:
    """The full data set, or a skip (from a test or at module level) saying how to provide it."""
    root = find_full_data()
    if root is None:
        pytest.skip(
            "the full Megatron golden data set is not here (no shared/data/megatron-golden "
            f"in an ancestor folder, ${ENV} unset); the carried subset is tested instead",
            allow_module_level=True,
        )
    return root


def head(rel: str) -> Path:
    return data_root() / "head" / rel


def history_index(root: Path) -> list[dict]:
    return json.loads((root / "history" / "index.json").read_text())


def history(case: str, subject_start: str) -> tuple[Path, Path]:
    """The version of ``case`` whose commit subject starts with ``subject_start``, and the one before."""
    root = data_root() / "history"
    entries = sorted(
        (e for e in history_index(data_root()) if e["case"] == case), key=lambda e: e["date"]
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
