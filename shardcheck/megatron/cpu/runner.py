"""Run a Megatron scenario on real Gloo ranks and compare it with its one-rank reference.

A small stand-in for the parity engine, enough for this package's tests: every Megatron
scenario returns global (replicated) values, so a run is checked by (1) every rank returning
the same values and (2) those values matching the one-rank run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardcheck.parity.launch import spawn_ranks


@dataclass
class RankContext:
    """What a scenario sees of its rank: the layout, its rank and (optionally) its groups."""

    layout: Any
    rank: int
    groups: dict[str, Any] = field(default_factory=dict)


def _on_rank(scenario: Callable[[Any], Mapping[str, torch.Tensor]], layout: Any) -> dict[str, np.ndarray]:
    outputs = scenario(RankContext(layout, dist.get_rank()))
    return {name: value.detach().double().numpy() for name, value in outputs.items()}


def run_ranks(scenario: Callable[[Any], Mapping[str, torch.Tensor]], layout: Any,
              timeout: float = 600.0) -> list[dict[str, np.ndarray]]:
    """Every rank's outputs of the scenario under ``layout``, in rank order."""
    return spawn_ranks(_on_rank, layout.world_size, scenario, layout, timeout=timeout)


def run_layout(scenario: Callable[[Any], Mapping[str, torch.Tensor]], layout: Any,
               timeout: float = 600.0) -> dict[str, np.ndarray]:
    """The scenario's outputs under ``layout``; raises if ranks disagree on a replicated output."""
    per_rank = run_ranks(scenario, layout, timeout)
    first = per_rank[0]
    for rank, outputs in enumerate(per_rank[1:], start=1):
        for name, value in outputs.items():
            if not np.allclose(value, first[name], rtol=1e-6, atol=1e-9):
                raise AssertionError(f"rank {rank} disagrees with rank 0 on replicated output {name!r}")
    return first


def relative_errors(observed: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                    ) -> dict[str, float]:
    """Per output: max |observed - reference| / max |reference| (absolute when the reference is 0)."""
    errors = {}
    for name, ref in reference.items():
        scale = float(np.abs(ref).max()) if ref.size else 0.0
        gap = float(np.abs(observed[name] - ref).max()) if ref.size else 0.0
        errors[name] = gap / scale if scale > 0 else gap
    return errors


def worst(errors: Mapping[str, float], prefix: str = "") -> tuple[str, float]:
    """The output (among names starting with ``prefix``) with the largest error."""
    picked = {k: v for k, v in errors.items() if k.startswith(prefix)}
    name = max(picked, key=picked.__getitem__)
    return name, picked[name]
