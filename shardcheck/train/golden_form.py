"""Write a training run in Megatron's golden-values form, as its functional tests store them.

Each metric is an object with ``start_step``, ``end_step``, ``step_interval`` and ``values``
keyed by step, so ``shardcheck golden check/compare/explain`` read these files as they read
CI's. MoE runs also write, beside the file, ``<name>.tokens.json``: per step, per router, the
tokens each expert received.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardcheck.train.records import Run

METRICS = {"lm loss": "lm loss", "num-zeros": "num-zeros", "grad norm": "grad norm",
           "iteration-time": "iteration-time"}


def golden_document(run: Run) -> dict[str, Any]:
    """The golden-values JSON object of ``run``."""
    doc: dict[str, Any] = {}
    steps = [s.step for s in run.steps]
    for key, metric in METRICS.items():
        values = {str(s.step): _value(s.metrics.get(metric)) for s in run.steps}
        if any(v != "nan" for v in values.values()):
            doc[key] = {"start_step": steps[0], "end_step": steps[-1], "step_interval": 1,
                        "values": values}
    return doc


def write_golden(run: Run, path: Path) -> Path:
    """Write ``run`` to ``path`` in golden-values form; return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden_document(run), indent=4) + "\n")
    tokens = {str(s.step): s.tokens_per_expert for s in run.steps if s.tokens_per_expert}
    if tokens:
        tokens_path(path).write_text(json.dumps(tokens) + "\n")
    return path


def tokens_path(path: Path) -> Path:
    """Where the tokens per expert of the golden file ``path`` are written."""
    return path.with_name(path.stem + ".tokens.json")


def _value(value: float | None) -> float | str:
    return "nan" if value is None else value
