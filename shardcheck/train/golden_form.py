"""Write a training run in Megatron's golden-values form, as its functional tests store them.

Each metric is an object with ``start_step``, ``end_step``, ``step_interval`` and ``values``
keyed by step, so ``shardcheck golden check/compare/explain`` read these files as they read
CI's. MoE runs also write, beside the file, ``<name>.tokens.json``: per step, per router, the
tokens each expert received. The flags of a run are written as a functional test's
``model_config.yaml`` (its MODEL_ARGS), for ``golden explain --model-config``; a run resumed
from a checkpoint writes its second run as ``<name>_2nd.json``, as the functional tests'
resume tests store theirs, and the config says where it resumed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardcheck.golden.io import tokens_path
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


def write_model_config(flags: list[str], path: Path, resume_at: int | None = None) -> Path:
    """Megatron ``flags`` as a model_config.yaml's MODEL_ARGS (a flag without a value: true).

    With ``resume_at`` it describes a resume test, as the functional tests' ``ckpt-resume``
    configs do: ``TEST_TYPE: ckpt-resume`` and ``--save-interval``, the step the second run
    restarted after (where ``golden check --second-run`` and ``golden compare`` split).
    """
    if resume_at is not None:
        flags = [*flags, "--save-interval", str(resume_at)]
    values: dict[str, str] = {}  # a flag given twice takes its last value, as Megatron's parser does
    for i, token in enumerate(flags):
        if token.startswith("--"):
            values[token] = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else "true"
    lines = ["MODEL_ARGS:", *(f"  {flag}: {value}" for flag, value in values.items())]
    if resume_at is not None:
        lines.append("TEST_TYPE: ckpt-resume")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _value(value: float | None) -> float | str:
    return "nan" if value is None else value
