"""One training run's per-step metrics, rebuilt from what each of its ranks recorded.

Each rank records, per step: the reduced metrics (``lm loss``, grad norm, num-zeros), and per
parameter the sum of squares of its gradient with a shard key (``""`` for a replica, else
which tensor-parallel shard it is). A parameter's global gradient norm adds the distinct
shards once each and ignores replicas; tokens per expert add the distinct token shards
(data-, context- and, under sequence parallelism, tensor-parallel ranks) once each.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RecordError(Exception):
    """A run's record is missing or unreadable; the message is one line."""


@dataclass
class Step:
    """One training step, as one rank would see it on one device."""

    step: int
    metrics: dict[str, float | None]  # "lm loss", "grad norm", "num-zeros", "iteration-time" (s)
    param_norms: dict[str, float] = field(default_factory=dict)
    tokens_per_expert: dict[str, list[int]] = field(default_factory=dict)
    param_zeros: dict[str, tuple[int, int]] = field(default_factory=dict)  # exact zeros, rounding-sized


@dataclass
class Run:
    """A whole run: its steps in order, and notes on what could not be recorded."""

    steps: list[Step]
    notes: list[str] = field(default_factory=list)
    violations: dict[str, list[int]] = field(default_factory=dict)  # checker line -> ranks

    def metric(self, name: str) -> list[float | None]:
        return [s.metrics.get(name) for s in self.steps]


def load_run(folder: Path) -> Run:
    """The run recorded in ``folder`` (one ``rank<R>.json`` per rank)."""
    try:
        ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
        if not ranks:
            raise RecordError(f"no rank recorded any step in {folder}")
        return merge_ranks(ranks)
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"unreadable step record in {folder}: {exc!r}") from exc


def merge_ranks(ranks: Sequence[dict[str, Any]]) -> Run:
    """Rebuild the global per-step metrics from every rank's record."""
    counts = {len(r["steps"]) for r in ranks}
    if len(counts) != 1:
        raise RecordError(f"ranks recorded different numbers of steps: {sorted(counts)}")
    last = [r for r in ranks if r["steps"] and r["steps"][0]["last_stage"]] or list(ranks)
    notes = []
    sharded_optimizer = any(r.get("distributed_optimizer") for r in ranks)
    if sharded_optimizer:
        notes.append("per-parameter gradient norms not compared: with --use-distributed-optimizer "
                     "each rank holds only its share of each reduced gradient")
    steps = []
    for i in range(counts.pop()):
        scalar = last[0]["steps"][i]
        metrics = {"lm loss": scalar["loss"].get("lm loss"), "grad norm": scalar["grad_norm"],
                   "num-zeros": scalar["num_zeros"],
                   "iteration-time": max((r["steps"][i].get("seconds", 0.0) for r in ranks), default=0.0)}
        params = [] if sharded_optimizer else [r["steps"][i].get("params", {}) for r in ranks]
        tokens = _tokens([(tuple(r["token_shard"]), r["steps"][i].get("tokens", {})) for r in ranks])
        steps.append(Step(scalar["step"], metrics, _param_norms(params), tokens, _param_zeros(params)))
    violations: dict[str, list[int]] = {}
    for r in ranks:
        for line in r.get("violations", []):
            violations.setdefault(line, []).append(r["rank"])
    return Run(steps, notes, violations)


def _shards(per_rank: Sequence[dict[str, list[Any]]]) -> dict[str, dict[str, list[Any]]]:
    """Parameter -> shard key -> that shard's record, each distinct shard once."""
    shards: dict[str, dict[str, list[Any]]] = {}
    for params in per_rank:
        for name, (shard, *values) in params.items():
            shards.setdefault(name, {}).setdefault(shard, values)
    return dict(sorted(shards.items()))


def _param_norms(per_rank: Sequence[dict[str, list[Any]]]) -> dict[str, float]:
    return {name: math.sqrt(sum(v[0] for v in parts.values())) for name, parts in _shards(per_rank).items()}


def _param_zeros(per_rank: Sequence[dict[str, list[Any]]]) -> dict[str, tuple[int, int]]:
    return {name: (sum(v[1] for v in parts.values()), sum(v[2] for v in parts.values()))
            for name, parts in _shards(per_rank).items() if all(len(v) >= 3 for v in parts.values())}


def _tokens(per_rank: Sequence[tuple[tuple[int, ...], dict[str, list[int]]]]) -> dict[str, list[int]]:
    seen: dict[str, dict[tuple[int, ...], list[int]]] = {}
    for shard, layers in per_rank:
        for layer, counts in layers.items():
            seen.setdefault(layer, {}).setdefault(shard, counts)
    return {layer: [sum(c) for c in zip(*parts.values(), strict=True)]
            for layer, parts in sorted(seen.items())}
