"""``shardcheck audit``: the type checker and parity over the generic sweep of megatron-core.

For each case of the sweep (:mod:`shardcheck.megatron.sweep`) the component runs on warm Gloo
ranks (one :class:`~shardcheck.pool.RankPool` per world size, since Megatron's
``parallel_state`` spans the whole default group) and on one rank. A case fails when an
output differs from the one-rank run (:mod:`shardcheck.megatron.divergence`); its contracted
calls locate the divergence in megatron-core, and the type checker, when present, gives the
``checker:`` line. Failures are deduplicated into findings by location and contract
(:mod:`shardcheck.megatron.findings`).

A single option is screened on one rank before it is swept: if the component fails with it
there, or it changes none of the one-rank outputs, it is not run under the layouts (it is
listed in the report's coverage section instead).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import torch

from shardcheck.layout import Layout
from shardcheck.megatron import contracts
from shardcheck.megatron.divergence import CallGap, Gap, first_call_gap, gap, output_gaps
from shardcheck.megatron.sweep import Case, setup_kwargs
from shardcheck.pool import PoolFailure, RankPool

PRELOAD = ("megatron.core.pipeline_parallel.schedules", "megatron.core.optimizer",
           "megatron.core.transformer.moe.router", "megatron.core.models.gpt.gpt_model",
           "shardcheck.megatron.scenarios")
RUN_TIMEOUT = 60.0


# ---- on each rank --------------------------------------------------------------------------

def run_case(ctx: Any, component: str, options: tuple, fixes: tuple[str, ...], typecheck: bool) -> dict:
    """Run one component with its options on this rank; outputs, contracted calls, violations."""
    from shardcheck.megatron.scenarios import COMPONENTS, scenario
    from shardcheck.megatron.typecheck import checked_region

    warnings.filterwarnings("ignore")
    contracts.install()
    run = scenario(component, **setup_kwargs(COMPONENTS[component].setup, options))
    with ExitStack() as stack:
        stack.enter_context(_groups_destroyed_after())
        calls = stack.enter_context(contracts.recording())
        stack.enter_context(contracts.fixed(fixes))
        found = stack.enter_context(checked_region(ctx) if typecheck else nullcontext([]))
        outputs = run(ctx)
    return {"outputs": {k: torch.as_tensor(v).detach().double().clone() for k, v in outputs.items()},
            "calls": calls, "violations": list(found)}


@contextmanager
def _groups_destroyed_after() -> Iterator[None]:
    """Destroy the process groups created inside the block (Megatron's, per run).

    Megatron's ``destroy_model_parallel`` forgets its groups without destroying them; in a
    warm rank that runs hundreds of cases they would pile up, each with its own Gloo threads.
    """
    import torch.distributed as dist

    created: list[dist.ProcessGroup] = []
    original = dist.new_group

    def tracked(*args: Any, **kwargs: Any) -> Any:
        group = original(*args, **kwargs)
        if isinstance(group, dist.ProcessGroup):
            created.append(group)
        return group

    dist.new_group = tracked
    try:
        yield
    finally:
        dist.new_group = original
        for group in {id(g): g for g in created if g is not dist.GroupMember.WORLD}.values():
            with suppress(ValueError):  # already gone: torch may hand out one group twice
                dist.destroy_process_group(group)


# ---- in the parent ------------------------------------------------------------------------

class Pools:
    """One warm rank pool per world size, started on first use."""

    def __init__(self, timeout: float = RUN_TIMEOUT) -> None:
        self.timeout = timeout
        self._pools: dict[int, RankPool] = {}

    def run(self, layout: Layout, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if layout.world_size not in self._pools:
            self._pools[layout.world_size] = RankPool(layout.world_size, timeout=self.timeout,
                                                      preload=PRELOAD)
        return self._pools[layout.world_size].run(layout, fn, *args)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.__exit__(None, None, None)
        self._pools.clear()


@contextmanager
def pools(timeout: float = RUN_TIMEOUT) -> Iterator[Pools]:
    owned = Pools(timeout)
    try:
        yield owned
    finally:
        owned.close()


@dataclass
class Outcome:
    """What one case gave: nothing wrong, gaps (numeric), violations (types), or an error."""

    case: Case
    gaps: list[Gap] = field(default_factory=list)
    call_gap: CallGap | None = None
    violations: list[dict] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.gaps or self.violations)


def _first_line(failure: PoolFailure) -> str:
    lines = [ln.strip() for ln in str(failure).splitlines() if ln.strip() and not ln.startswith(" ")]
    errors = [ln for ln in lines if not ln.startswith(("rank ", "last collective", "Traceback"))]
    return (errors[-1] if errors else lines[0] if lines else failure.kind)[:300]


class Runner:
    """Runs cases and their one-rank references through the pools, caching references."""

    def __init__(self, runner_pools: Pools, typecheck: bool) -> None:
        self.pools = runner_pools
        self.typecheck = typecheck
        self.references: dict[tuple[str, tuple], dict | str] = {}

    def reference(self, component: str, options: tuple) -> dict | str:
        """The one-rank result of a component with options, or the error line when it fails."""
        key = (component, options)
        if key not in self.references:
            try:
                self.references[key] = self.pools.run(Layout(), run_case, component, options, (), False)[0]
            except PoolFailure as failure:
                self.references[key] = _first_line(failure)
        return self.references[key]

    def screen(self, component: str, options: tuple) -> str | None:
        """Why an option is not swept (fails, or changes nothing at one rank), else None."""
        ref = self.reference(component, options)
        if isinstance(ref, str):
            return f"fails on one rank: {ref}"
        if not options:
            return None
        base = self.reference(component, ())
        if isinstance(base, dict) and _same_outputs(ref["outputs"], base["outputs"]):
            return "changes no output at one rank"
        return None

    def run(self, case: Case, fixes: tuple[str, ...] = ()) -> Outcome:
        started = time.monotonic()
        ref = self.reference(case.component, case.options)
        assert isinstance(ref, dict), "screened cases have a reference"
        try:
            ranks = self.pools.run(case.layout, run_case, case.component, case.options, fixes, self.typecheck)
        except PoolFailure as failure:
            return Outcome(case, error=_first_line(failure), seconds=time.monotonic() - started)
        outcome = Outcome(case, output_gaps([r["outputs"] for r in ranks], ref["outputs"]),
                          first_call_gap(case.layout, [r["calls"] for r in ranks], ref["calls"]),
                          _unique(v for r in ranks for v in r["violations"]))
        outcome.seconds = time.monotonic() - started
        return outcome


def _same_outputs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def _unique(violations) -> list[dict]:
    seen: dict[tuple, dict] = {}
    for v in violations:
        seen.setdefault((v["rule"], v["location"]), v)
    return list(seen.values())


def corrected_gap(runner: Runner, case: Case, contract: str) -> tuple[Outcome, Gap | None]:
    """Rerun ``case`` with the contract's fix patched in; the outcome and its worst remaining gap."""
    outcome = runner.run(case, fixes=(contract,))
    worst = max(outcome.gaps, key=lambda g: g.max_error, default=None)
    return outcome, worst


__all__ = ["Outcome", "Pools", "Runner", "corrected_gap", "gap", "pools", "run_case"]
