"""Run one fuzz example of a scenario and judge it: the only glue between the fuzzer and the runners.

A scenario (``scenario(ctx, **config) -> dict[str, Tensor]``, see :mod:`shardcheck.scenario`)
runs on real Gloo ranks under the example's layout and, once more, under the one-rank layout
as the reference. Every output is compared with the reference; the first that differs, or a
rank that raises or hangs, makes the example fail.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.launch import RankFailure, spawn_ranks
from shardcheck.layout import Layout
from shardcheck.scenario import ScenarioContext, active, build_groups

RTOL, ATOL = 1e-4, 1e-6
TRIAL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Failure:
    """Why an example is wrong: where, which contract it breaks, and by how much."""

    title: str
    location: str
    contract: str
    max_error: float | None = None
    checker: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        """What deduplicates findings: the code location and the contract."""
        return self.location, self.contract


@dataclass(frozen=True)
class Verdict:
    """The numbers one example produced, its reference, and its failure (None when right)."""

    observed: dict[str, Any]
    reference: dict[str, Any]
    failure: Failure | None = None


Check = Callable[[Mapping[str, Any]], Verdict]


def scenario_check(scenario: Callable[..., Mapping[str, torch.Tensor]]) -> Check:
    """A check that runs ``scenario`` with the example's layout and config against the reference."""
    return partial(run_trial, scenario)


def split_example(example: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The layout string and the configuration of a fuzz example."""
    config = dict(example)
    return str(config.pop("layout")), config


def run_trial(scenario: Callable[..., Mapping[str, torch.Tensor]], example: Mapping[str, Any]) -> Verdict:
    """Run one example of ``scenario`` and compare every output with the one-rank reference."""
    layout, config = split_example(example)
    where = f"{scenario.__module__}:{scenario.__qualname__}"
    try:
        per_rank = spawn_ranks(_run_on_rank, Layout.parse(layout).world_size, scenario, layout, config,
                               timeout=TRIAL_TIMEOUT_S)
    except RankFailure as failure:
        return Verdict({}, {}, _raised(failure, where))
    except TimeoutError as hang:
        return Verdict({}, {}, Failure(f"{where} hangs under {layout}: {hang}", where, "finishes"))
    reference = per_rank[0][1]
    observed = {name: value for name, value in per_rank[0][0].items()}
    for name in reference:
        for rank, (outputs, _) in enumerate(per_rank):
            error = _max_error(outputs[name], reference[name])
            if error is not None:
                observed[name] = outputs[name]
                return Verdict(observed, reference, Failure(
                    f"{name} differs from the one-rank reference under {layout} (rank {rank})",
                    where, f"output {name!r} equals the one-rank reference", error))
    return Verdict(observed, reference)


def _run_on_rank(scenario, layout_text: str, config: dict[str, Any]):
    """This rank's outputs under the layout, and on rank 0 the one-rank reference too."""
    rank = dist.get_rank()
    outputs = _run_scenario(scenario, Layout.parse(layout_text), rank, config)
    alone = build_groups(Layout(), rank)  # every rank takes part in creating the groups
    reference = _run_scenario(scenario, Layout(), 0, config, alone) if rank == 0 else None
    return outputs, reference


def _run_scenario(scenario, layout: Layout, rank: int, config: dict[str, Any],
                  groups: dict | None = None) -> dict[str, list | float]:
    ctx = ScenarioContext(layout, rank, groups or build_groups(layout, rank))
    with active(ctx):
        outputs = scenario(ctx, **config)
    return {name: _numbers(value) for name, value in outputs.items()}


def _numbers(value: torch.Tensor) -> list | float:
    value = value.detach().double()
    return value.item() if value.numel() == 1 else value.tolist()


def _max_error(got: list | float, want: list | float) -> float | None:
    """The largest absolute difference when it is beyond tolerance, else None."""
    got_t, want_t = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    if got_t.shape != want_t.shape:
        return float("inf")
    if torch.allclose(got_t, want_t, rtol=RTOL, atol=ATOL, equal_nan=True):
        return None
    return (got_t - want_t).abs().max().item()


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _raised(failure: RankFailure, where: str) -> Failure:
    """A rank's exception as a failure located at the innermost frame outside torch."""
    frames = [(f, line) for f, line in _FRAME.findall(failure.traceback) if "/torch/" not in f]
    location = f"{frames[-1][0]}:{frames[-1][1]}" if frames else where
    last_line = failure.traceback.strip().splitlines()[-1]
    return Failure(f"rank {failure.rank} raised {last_line}", location, "runs without raising")
