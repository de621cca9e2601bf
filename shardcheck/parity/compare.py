"""Parity: run a scenario under several layouts and compare it with its one-rank reference.

Every named output, every registered module's forward output (by module name, in execution
order) and every parameter gradient is rebuilt into its global value (see
:mod:`shardcheck.parity.assemble`) and compared with the reference run of the same scenario on one
rank. The reference is also rerun with its inputs perturbed by a few machine epsilons to
estimate how much rounding alone moves each value; tolerances follow from that.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from rich.console import Console, Group
from rich.table import Table

import shardcheck
from shardcheck.parity.assemble import NotComparable, compare
from shardcheck.parity.layout import BASE_DIMS, Layout
from shardcheck.parity.pool import PoolFailure, RankPool, in_torchrun, run_in_place
from shardcheck.parity.scenario import Scenario, ScenarioContext, scenario_outputs
from shardcheck.typecheck.checker import confirmed_across_ranks
from shardcheck.typecheck.types import Placement, V, parse_placement

PERTURBATION_EPS = 4.0  # noise runs perturb every sharded global tensor by this many epsilons
KINDS = ("output", "module", "grad")

Types = tuple[dict[str, str], dict[str, str]]  # declared by the scenario, found by the checker
Entry = tuple[str, str, torch.Tensor, Types]  # kind, name, value, types


def _types(declared: Mapping[str, Placement] | None, tensor: torch.Tensor, checker) -> Types:
    """Declared placements, and the checker's on the other axes, as strings."""
    declared = {axis: repr(p) for axis, p in (declared or {}).items() if axis in BASE_DIMS}
    if checker is None:
        return declared, {}
    # V from the checker off dp mostly means "never annotated": leave those axes to inference
    found = {a: repr(p) for a, p in checker.typeof(tensor).items()
             if a in BASE_DIMS and a not in declared and (p is not V or a == "dp")}
    return declared, found


def _entries(ctx: ScenarioContext, outputs: Mapping[str, object], checker) -> list[Entry]:
    entries: list[Entry] = []
    for name, value in outputs.items():
        tensor = torch.as_tensor(value)
        entries.append(("output", name, tensor, _types(ctx.declared_types(tensor), tensor, checker)))
    seen: Counter[str] = Counter()
    for name, tensor in ctx.module_outputs or []:
        seen[name] += 1
        label = name if seen[name] == 1 else f"{name}#{seen[name]}"
        entries.append(("module", label, tensor, _types(ctx.module_types.get(name), tensor, checker)))
    for prefix, model in ctx.models:
        for name, param in model.named_parameters(prefix=prefix):
            if param.grad is not None:
                entries.append(("grad", name, param.grad, _types(ctx.declared_types(param), param.grad, checker)))
    return [(kind, name, value.detach().cpu().clone(), types) for kind, name, value, types in entries]


def capture(ctx: ScenarioContext, scenario: Scenario, perturbation: float, seed: int,
            typecheck: bool) -> dict:
    """Run ``scenario`` on this rank and return its outputs, module outputs and gradients."""
    ctx.perturb_inputs(perturbation, seed)
    ctx.module_outputs = []
    torch.manual_seed(0)
    checker = shardcheck if typecheck else None  # the checker's API: typecheck, typeof, violations
    region = checker.typecheck(ctx.mesh, mode="collect") if checker else nullcontext()
    region.__enter__()
    try:
        entries = _entries(ctx, scenario_outputs(scenario, ctx), checker)
        violations = [v.as_dict() for v in checker.violations()] if checker else []
    except BaseException:
        region.__exit__(*sys.exc_info())
        raise
    with contextlib.redirect_stderr(io.StringIO()):  # the table lists violations; drop the summary
        region.__exit__(None, None, None)
    return {"entries": entries, "violations": violations}


@dataclass
class Row:
    """One compared value."""

    kind: str
    name: str
    types: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    tol: float | None = None
    verdict: str = "ok"

    @property
    def ok(self) -> bool:
        return self.verdict == "ok" or self.verdict.startswith("skipped")


@dataclass
class LayoutReport:
    """All rows for one layout, or the failure that stopped its run."""

    layout: Layout
    rows: list[Row] = field(default_factory=list)
    failure: str | None = None
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failure is None and all(row.ok for row in self.rows)

    @property
    def first_divergence(self) -> str | None:
        """The first diverging module in execution order (else the first diverging value)."""
        bad = [row for row in self.rows if not row.ok]
        modules = [row for row in bad if row.kind == "module"]
        return (modules or bad)[0].name if bad else None

    def row(self, kind: str, name: str) -> Row:
        return next(r for r in self.rows if r.kind == kind and r.name == name)

    def table(self) -> Table:
        status = "FAILED" if self.failure else "ok" if self.ok else "MISMATCH"
        caption = f"first diverging module: {self.first_divergence}" if self.first_divergence else None
        table = Table(title=f"parity {self.layout} vs 1 rank: {status}", caption=caption,
                      title_justify="left", caption_justify="left")
        for column in ("kind", "name", "type", "max abs err", "max rel err", "tol", "verdict"):
            table.add_column(column, justify="right" if "err" in column or column == "tol" else "left")
        for row in self.rows:
            table.add_row(row.kind, row.name, row.types, _num(row.max_abs), _num(row.max_rel),
                          _num(row.tol), row.verdict if row.ok else f"[bold red]{row.verdict}[/]")
        return table


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.2e}"


@dataclass
class ParityResult:
    """Reports for every layout; ``str()`` is the table, ``ok`` is False on any mismatch."""

    reports: list[LayoutReport]

    @property
    def ok(self) -> bool:
        return all(report.ok for report in self.reports)

    def __getitem__(self, layout: Layout | str) -> LayoutReport:
        layout = Layout.coerce(layout)
        return next(r for r in self.reports if r.layout == layout)

    def __rich__(self) -> Group:
        parts: list = []
        for report in self.reports:
            parts.append(report.table())
            parts += [f"[red]{line}[/]" for line in (report.failure or "").splitlines()]
            parts += [f"checker: {v}" if not v.startswith("checker:") else v for v in report.violations]
        return Group(*parts)

    def __str__(self) -> str:
        console = Console(file=io.StringIO(), width=120, color_system=None, highlight=False)
        console.print(self)
        return console.file.getvalue().rstrip()


Runner = Callable[..., list | None]


def _merge_types(per_rank: Sequence[Types]) -> tuple[dict[str, Placement], dict[str, Placement]]:
    """One rank's declared and checker placements (the lowest rank wins where ranks differ)."""
    declared: dict[str, str] = {}
    checked: dict[str, str] = {}
    for rank_declared, rank_checked in reversed(per_rank):
        declared.update(rank_declared)
        checked.update(rank_checked)
    return _parsed(declared), _parsed(checked)


def _parsed(types: Mapping[str, str]) -> dict[str, Placement]:
    return {axis: parse_placement(text) for axis, text in types.items()}


def _noise(reference: torch.Tensor, noisy: Iterable[torch.Tensor | None]) -> float:
    changes = [(n.double() - reference.double()).abs().max().item() for n in noisy
               if n is not None and n.shape == reference.shape and n.numel()]
    return max(changes, default=0.0)


def _row(kind: str, name: str, values: list[torch.Tensor], types: list[Types],
         reference: torch.Tensor, noise: float, layout: Layout) -> Row:
    declared, checked = _merge_types(types)
    try:
        found = compare(values, reference, noise, layout, {**checked, **declared})
    except NotComparable as why:
        if not checked:
            return Row(kind, name, verdict=f"skipped: {why}")
        try:  # the checker's types give no global value of this shape: infer them instead
            found = compare(values, reference, noise, layout, declared)
        except NotComparable:
            return Row(kind, name, verdict=f"skipped: {why}")
    shown = " ".join(f"{a}={p}{'*' if a in found.inferred else ''}" for a, p in found.placements.items())
    verdict = ("REPLICA MISMATCH on " + ",".join(found.replica_mismatch) if found.replica_mismatch
               else "ok" if found.ok else "MISMATCH")
    return Row(kind, name, shown, found.max_abs, found.max_rel, found.tol, verdict)


def _check_layout(runner: Runner, layout: Layout, scenario: Scenario, reference: list[Entry],
                  noisy: list[dict], typecheck: bool) -> LayoutReport:
    try:
        ranks = runner(layout, capture, scenario, 0.0, 0, typecheck)
    except PoolFailure as failure:
        return LayoutReport(layout, failure=str(failure))
    if ranks is None:  # a torchrun rank other than 0
        return LayoutReport(layout)
    by_rank = [{(k, n): (v, t) for k, n, v, t in rank["entries"]} for rank in ranks]
    confirmed = confirmed_across_ranks(rank["violations"] for rank in ranks)
    report = LayoutReport(layout, violations=sorted({v["line"] for v in confirmed}))
    for kind, name, ref_value, _ in reference:
        missing = [r for r, entries in enumerate(by_rank) if (kind, name) not in entries]
        if missing:
            report.rows.append(Row(kind, name, verdict=f"missing on ranks {missing}"))
            continue
        values, types = zip(*(entries[(kind, name)] for entries in by_rank), strict=True)
        noise = _noise(ref_value, (run.get((kind, name)) for run in noisy))
        report.rows.append(_row(kind, name, list(values), list(types), ref_value, noise, layout))
    return report


def parity(scenario: Scenario, layouts: Iterable[Layout | str], *, pool: RankPool | None = None,
           timeout: float = 120.0, noise_runs: int = 2, typecheck: bool = True) -> ParityResult | None:
    """Compare ``scenario`` under each layout with its one-rank reference.

    Runs through ``pool`` (or a fresh :class:`RankPool` sized for the largest layout). Under
    torchrun (RANK and WORLD_SIZE set) it runs in place; rank 0 returns the result, the others None.
    """
    layouts = [Layout.coerce(layout) for layout in layouts]
    if in_torchrun():
        return _parity(run_in_place, scenario, layouts, noise_runs, typecheck)
    if pool is None:
        with RankPool(max(layout.world_size for layout in layouts), timeout=timeout) as own:
            return _parity(own.run, scenario, layouts, noise_runs, typecheck)
    return _parity(functools.partial(pool.run, timeout=timeout), scenario, layouts, noise_runs, typecheck)


def _parity(runner: Runner, scenario: Scenario, layouts: list[Layout], noise_runs: int,
            typecheck: bool) -> ParityResult | None:
    reference = runner(Layout(), capture, scenario, 0.0, 0, False)
    noisy = [runner(Layout(), capture, scenario, PERTURBATION_EPS, seed, False)
             for seed in range(1, noise_runs + 1)]
    reports = [_check_layout(runner, layout, scenario, reference[0]["entries"] if reference else [],
                             [{(k, n): v for k, n, v, _ in run[0]["entries"]} for run in noisy if run],
                             typecheck) for layout in layouts]
    return ParityResult(reports) if reference is not None else None
