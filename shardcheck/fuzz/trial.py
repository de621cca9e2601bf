"""Run one fuzz example of a scenario and judge it: the only glue between the fuzzer and parity.

An example ``{"layout": "tp2", **config}`` becomes a scenario ``make_scenario(**config)`` (see
:mod:`shardcheck.parity.scenario`), run by :func:`shardcheck.parity.compare.parity` through a warm
:class:`~shardcheck.parity.pool.RankPool` under the layout and compared with its one-rank reference;
the type checker runs too when it is installed. The example fails when a value mismatches, a
replica disagrees, the checker reports a violation, or a rank raises, hangs or desyncs.
"""

from __future__ import annotations

import atexit
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from shardcheck.fuzz.findings import TYPE_ONLY
from shardcheck.parity.assemble import NotComparable, assemble, compare
from shardcheck.parity.compare import LayoutReport, Row, capture, parity
from shardcheck.parity.layout import Layout
from shardcheck.parity.pool import PoolFailure, RankPool
from shardcheck.typecheck.types import parse_placement

TRIAL_TIMEOUT_S = 60.0
NUMERIC, TYPE, BOTH, RUN = "numeric-only", TYPE_ONLY, "numeric+type", "run"


@dataclass(frozen=True)
class Failure:
    """Why an example is wrong: where, which contract it breaks, and by how much."""

    title: str
    location: str
    contract: str
    max_error: float | None = None
    checker: str | None = None
    kind: str = NUMERIC

    @property
    def key(self) -> tuple[str, str]:
        """What deduplicates findings: the code location and the contract."""
        return self.location, self.contract

    @property
    def search_key(self) -> tuple[str, str, bool]:
        """What the search shrinks separately: the key, and whether the numbers show the bug.

        A type violation shrinks to examples whose numbers may happen to agree; its smallest
        example with wrong numbers is kept too, as the trigger a repro script can show.
        """
        return self.location, self.contract, self.kind != TYPE


@dataclass(frozen=True)
class ExampleVerdict:
    """A fuzz example's failure (None when right), and the numbers when the check has them (not the
    oracle's verdict on the checker: :class:`~shardcheck.fuzz.oracle.OracleVerdict`)."""

    failure: Failure | None = None
    observed: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None


Check = Callable[[Mapping[str, Any]], ExampleVerdict]
Measure = Callable[[Mapping[str, Any]], tuple[dict[str, Any], dict[str, Any]]]
MakeScenario = Callable[..., Callable[[Any], Mapping[str, torch.Tensor]]]


def split_example(example: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The layout string and the configuration of a fuzz example."""
    config = dict(example)
    return str(config.pop("layout")), config


_POOL: list[RankPool] = []


def shared_pool(world_size: int) -> RankPool:
    """The warm pool kept for all trials, restarted larger when a layout needs more ranks."""
    if _POOL and _POOL[0].world_size >= world_size:
        return _POOL[0]
    close_pool()
    _POOL.append(RankPool(world_size, timeout=TRIAL_TIMEOUT_S))
    return _POOL[0]


def use_pool(pool: RankPool) -> None:
    """Run the trials on ``pool`` (e.g. one whose ranks preloaded Megatron) instead of our own."""
    close_pool()
    _POOL.append(pool)


@atexit.register
def close_pool() -> None:
    """Stop the shared pool's ranks."""
    while _POOL:
        _POOL.pop().close()


def scenario_check(make_scenario: MakeScenario, where: str, typecheck: bool = True) -> Check:
    """A check running ``make_scenario(**config)`` through parity; ``where`` names it in findings.

    ``typecheck=False`` skips the type checker, for code whose inputs carry no declared types.
    """
    return partial(_check, make_scenario, where, typecheck)


def scenario_measure(make_scenario: MakeScenario) -> Measure:
    """The named outputs' global values under the example's layout, and the reference values."""
    return partial(_measure, make_scenario)


def _check(make_scenario: MakeScenario, where: str, typecheck: bool, example: Mapping[str, Any]) -> ExampleVerdict:
    layout_text, config = split_example(example)
    layout = Layout.parse(layout_text)
    result = parity(make_scenario(**config), [layout], pool=shared_pool(layout.world_size),
                    timeout=TRIAL_TIMEOUT_S, typecheck=typecheck)
    return ExampleVerdict(judge(result.reports[0], where))


def judge(report: LayoutReport, where: str) -> Failure | None:
    """The failure a parity report shows, located by the checker when it explains it."""
    if report.failure:
        return _run_failure(report.failure, where)
    bad = [row for row in report.rows if not row.ok]
    first = next((row for row in bad if row.name == report.first_divergence), bad[0]) if bad else None
    violation = next(filter(None, map(_parse_violation, report.violations)), None)
    if violation is not None:
        rule, location, line = violation
        return Failure(_title(first, report.layout, line), location, f"checker rule {rule!r}",
                       first.max_abs if first else None, line, BOTH if first else TYPE)
    if first is None:
        return None
    return Failure(_title(first, report.layout), f"{where}, {first.kind} {first.name}",
                   _contract(first), first.max_abs, None, NUMERIC)


def _contract(row: Row) -> str:
    if row.verdict.startswith("REPLICA"):
        return f"{row.kind} {row.name}: replicas agree"
    return f"{row.kind} {row.name} matches the one-rank reference"


def _title(row: Row | None, layout: Layout, violation: str | None = None) -> str:
    if row is None:
        return f"type violation under {layout}: {violation}"
    return (f"{row.kind} {row.name} [{row.types}] {row.verdict.lower()} under {layout}: "
            f"max abs err {row.max_abs:.3g} > tol {row.tol:.3g}")


_VIOLATION = re.compile(r"checker: (?P<rule>.+?) at (?P<location>\S+:\d+) in (?P<op>[^\s:]+):(?P<rest>[^\n\\']*)")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _parse_violation(text: str) -> tuple[str, str, str] | None:
    """The rule, the file:line and the ``checker: ...`` line in a reported violation."""
    match = _VIOLATION.search(text)
    return (match["rule"], match["location"], match[0].rstrip()) if match else None


def _run_failure(text: str, where: str) -> Failure:
    """A rank that raised (located at its innermost frame outside torch), hung or desynced."""
    first_line = text.strip().splitlines()[0]
    if "desync" in first_line.lower():
        return Failure(first_line, where, "ranks enter the same collectives", kind=RUN)
    if "raised" not in first_line:
        return Failure(f"hang: {first_line}", where, "every rank finishes", kind=RUN)
    frames = [f"{file}:{line}" for file, line in _FRAME.findall(text) if "/torch/" not in file]
    error = next((line for line in reversed(text.splitlines()) if line and not line[0].isspace()
                  and not line.startswith("last collective")), first_line)
    return Failure(f"{first_line} {error}", frames[-1] if frames else where, "runs without raising", kind=RUN)


def _measure(make_scenario: MakeScenario, example: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    layout_text, config = split_example(example)
    layout, scenario = Layout.parse(layout_text), make_scenario(**config)
    pool = shared_pool(layout.world_size)
    try:
        reference = _outputs(pool.run(Layout(), capture, scenario, 0.0, 0, False)[0])
    except PoolFailure as failure:
        return {}, {"error": _run_failure(str(failure), "").title}
    try:
        per_rank = [_outputs(rank) for rank in pool.run(layout, capture, scenario, 0.0, 0, False)]
    except PoolFailure as failure:
        observed: dict[str, Any] = {"error": _run_failure(str(failure), "").title}
    else:
        observed = {name: _global_value([rank[name] for rank in per_rank], value[0], layout)
                    for name, value in reference.items()}
    return observed, {name: _numbers(value) for name, (value, _) in reference.items()}


def _outputs(captured: dict) -> dict[str, tuple[torch.Tensor, dict[str, str]]]:
    """Named outputs of one rank's parity capture, with their placements (declared or checked)."""
    return {name: (value, {axis: text for part in types for axis, text in part.items()})
            for kind, name, value, types in captured["entries"] if kind == "output"}


def _global_value(values: list[tuple[torch.Tensor, dict[str, str]]], reference: torch.Tensor,
                  layout: Layout) -> Any:
    """Rank values assembled by their (declared or inferred) placements; rank 0's if impossible."""
    known = {axis: parse_placement(text) for _, types in values for axis, text in types.items()}
    tensors = [value for value, _ in values]
    try:
        placements = compare(tensors, reference, 0.0, layout, known).placements
        return _numbers(assemble(tensors, layout, placements)[0])
    except NotComparable:
        return _numbers(tensors[0])


def _numbers(value: torch.Tensor) -> list | float:
    value = value.detach().double()
    return value.item() if value.numel() == 1 else value.tolist()
