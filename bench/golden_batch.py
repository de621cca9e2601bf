"""Benchmark: load and compare every training-format golden file of head/ against a perturbed copy.

The perturbed copy is made in a temporary directory (not timed): every numeric value is
scaled by 1 + 1% * sin(step), and num-zeros gains one whole 1,048,576 block at step 7.
Goal: the timed load + compare of both trees finishes in under 5 s.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from shardcheck.golden.compare import compare_trees

GOAL_S = 5.0


def data_head() -> Path:
    """$SHARDCHECK_GOLDEN_DATA/head, else the nearest ancestor's shared/data/megatron-golden/head."""
    if os.environ.get("SHARDCHECK_GOLDEN_DATA"):
        return Path(os.environ["SHARDCHECK_GOLDEN_DATA"]) / "head"
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "shared" / "data" / "megatron-golden" / "head"
        if candidate.is_dir():
            return candidate
    sys.exit("golden data not found; set SHARDCHECK_GOLDEN_DATA")


def perturb(doc: object) -> object:
    """A perturbed copy of a training-format document; anything else unchanged."""
    if not isinstance(doc, dict):
        return doc
    out = {}
    for name, block in doc.items():
        values = block.get("values") if isinstance(block, dict) else None
        if not isinstance(values, dict):
            out[name] = block
            continue
        new_values = {
            step: v * (1 + 0.01 * math.sin(int(step))) if isinstance(v, int | float) else v
            for step, v in values.items()
        }
        if name == "num-zeros" and isinstance(new_values.get("7"), int | float):
            new_values["7"] += 1_048_576
        out[name] = {**block, "values": new_values}
    return out


def make_perturbed_tree(head: Path, target: Path) -> None:
    for path in head.rglob("golden_values*.json"):
        text = path.read_text()
        try:
            text = json.dumps(perturb(json.loads(text)))
        except json.JSONDecodeError:
            pass  # empty or broken files are copied as they are
        out = target / path.relative_to(head)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def main() -> int:
    head = data_head()
    with tempfile.TemporaryDirectory() as tmp:
        perturbed = Path(tmp) / "head"
        make_perturbed_tree(head, perturbed)
        start, start_cpu = time.perf_counter(), time.process_time()
        results = compare_trees(head, perturbed)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    compared = [r for r in results if not r.skipped]
    series = sum(len(r.metrics) for r in compared)
    print(
        f"golden_batch: {len(compared)} training files compared ({series} metric series), "
        f"{len(results) - len(compared)} rejected as unusable"
    )
    print(
        f"golden_batch: {elapsed:.2f} s wall, {cpu:.2f} s CPU "
        f"(goal {GOAL_S:.0f} s, {elapsed / GOAL_S:.2f}x of goal; load average {os.getloadavg()[0]:.1f})"
    )
    return 0 if elapsed < GOAL_S else 1


if __name__ == "__main__":
    sys.exit(main())
