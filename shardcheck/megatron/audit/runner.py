"""The audit's runs: warm rank pools per world size (:class:`Pools`), and the :class:`Runner`
that runs a case on them and its one-rank reference (cached), screens an option on one rank, and
prunes the cases whose options the component's default run never read."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardcheck.megatron.audit.divergence import (
    CallGap,
    OpGap,
    compute_dtype,
    first_call_gap,
    first_op_gap,
    max_errors,
    output_gaps,
    split_gradient_gap,
)
from shardcheck.megatron.audit.hosted import TEHost
from shardcheck.megatron.audit.outcome import Outcome, first_line, op_counts
from shardcheck.megatron.audit.rank import CaseResult, run_case
from shardcheck.megatron.audit.sweep import (
    Case,
    changed_config_fields,
    impl_of,
    layout_dependent_fields,
)
from shardcheck.parity.layout import Layout
from shardcheck.parity.pool import PoolFailure, RankPool
from shardcheck.typecheck.checker import confirmed_across_ranks

PRELOAD = ("megatron.core.pipeline_parallel.schedules", "megatron.core.optimizer",
           "megatron.core.transformer.moe.router", "megatron.core.models.gpt.gpt_model",
           "megatron.core.models.T5.t5_model", "megatron.core.models.multimodal.llava_model",
           "shardcheck.megatron.scenarios", "megatron.core.ssm.gated_delta_net")
RUN_TIMEOUT = 30.0
INERT = "changes no output at one rank"
FAILS = "fails on one rank"
LAYOUT_MEANING = ("the config derives its meaning from the parallel sizes, so the one-rank run "
                  "is another computation")


class Pools:
    """One warm rank pool per world size, started on first use, and the one-rank references
    computed on them (the same megatron-core for the pools' life, so every audit over these
    pools reuses them). Jobs of cases on Transformer Engine (``impl="te"``) run on the pools of
    a :class:`~shardcheck.megatron.audit.hosted.TEHost`, started on first use."""

    def __init__(self, timeout: float = RUN_TIMEOUT) -> None:
        self.timeout = timeout
        self._pools: dict[int, RankPool] = {}
        self._te: TEHost | None = None
        self.references: dict[tuple[str, tuple, int], CaseResult | str] = {}
        self.failures: dict[tuple[str, tuple, int], Outcome] = {}  # the references that raised

    def run(self, layout: Layout, fn: Callable[..., Any], *args: Any, impl: str = "local") -> list[Any]:
        if impl == "te":
            if self._te is None:
                self._te = TEHost(self.timeout, _importable(PRELOAD))
            return self._te.run(layout, fn, *args)
        if layout.world_size not in self._pools:
            self._pools[layout.world_size] = RankPool(layout.world_size, timeout=self.timeout,
                                                      preload=_importable(PRELOAD))
        return self._pools[layout.world_size].run(layout, fn, *args)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.__exit__(None, None, None)
        self._pools.clear()
        if self._te is not None:
            self._te.close()
            self._te = None


def _importable(modules: Iterable[str]) -> list[str]:
    """The modules of ``modules`` that this megatron-core has (a release may lack one)."""
    import importlib

    found = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        found.append(name)
    return found


def cpu_patch_status(_ctx: Any) -> dict[str, str]:
    """On a rank: each CPU patch, applied or why this version does not need it."""
    from shardcheck.megatron.cpu import patches as cpu

    cpu.apply_cpu_patches()
    return cpu.patch_status()


@contextmanager
def pools(timeout: float = RUN_TIMEOUT) -> Iterator[Pools]:
    """Pools for the block, closed after it."""
    owned = Pools(timeout)
    try:
        yield owned
    finally:
        owned.close()


class Runner:
    """Runs cases and their one-rank references through the pools, caching references."""

    def __init__(self, runner_pools: Pools, typecheck: bool) -> None:
        self.pools = runner_pools
        self.typecheck = typecheck
        self.references = runner_pools.references
        self.read_sets: dict[tuple[str, str], frozenset[str]] = {}  # defaults' reads per layout
        self.prune = True
        self._changed: dict[tuple, frozenset[str] | None] = {}
        self._meaning: dict[tuple, str | None] = {}
        self._asked: dict[tuple[str, tuple, int], None] = {}  # references asked for, in order

    def not_read(self, case: Case) -> frozenset[str] | None:
        """The config fields the case's options change when the component's default run under
        the same layout read none of them (so the case would run exactly as the defaults):
        the case is pruned. None: run it."""
        reads = self.read_sets.get((case.component, str(case.layout)))
        if not self.prune or reads is None or not case.options:
            return None
        key = (case.component, case.options, str(case.layout))
        if key not in self._changed:
            self._changed[key] = changed_config_fields(case.component, case.options, case.layout)
        changed = self._changed[key]
        return changed if changed is not None and not changed & reads else None

    def other_meaning(self, case: Case) -> str | None:
        """Why the case's one-rank reference is another computation, else None: its options
        make config fields depend on the parallel sizes (see
        :func:`~shardcheck.megatron.audit.sweep.layout_dependent_fields`)."""
        key = (case.component, case.options, str(case.layout))
        if key not in self._meaning:
            fields = layout_dependent_fields(case.component, case.options, case.layout)
            shown = ", ".join(f"{name}={here!r} here but {alone!r} on one rank"
                              for name, (here, alone) in sorted(fields.items()))
            self._meaning[key] = f"{LAYOUT_MEANING} ({shown})" if fields else None
        return self._meaning[key]

    def reference(self, component: str, options: tuple, rng_offset: int = 0) -> CaseResult | str:
        """The one-rank result of a component with options, or the error line when it fails."""
        key = (component, options, rng_offset)
        if key not in self.references:
            try:
                self.references[key] = self.pools.run(Layout(), run_case, component, options, (),
                                                      False, rng_offset, impl=impl_of(options, component))[0]
            except PoolFailure as failure:
                self.references[key] = first_line(failure)
                self.pools.failures[key] = Outcome.raised(Case(component, options, Layout()), failure)
        self._asked.setdefault(key)
        return self.references[key]

    def one_rank_failures(self) -> list[Outcome]:
        """The option sets this runner screened whose one-rank reference raised, as outcomes at
        one rank (their traceback read: a refusal of the arguments, or a crash in megatron-core)."""
        return [self.pools.failures[key] for key in self._asked
                if key in self.pools.failures and key[1] and not key[2]]

    def screen(self, component: str, options: tuple) -> str | None:
        """Why an option is not swept, else None: it fails or changes nothing at one rank, or
        its outputs depend on the RNG seed (each rank of a layout draws its own random stream,
        so such outputs have no one-rank reference)."""
        ref = self.reference(component, options)
        if isinstance(ref, str):
            return f"{FAILS}: {ref}"
        base = self.reference(component, ())
        if options and isinstance(base, CaseResult) and _same_outputs(ref.outputs, base.outputs):
            return INERT
        reseeded = self.reference(component, options, rng_offset=1)
        if isinstance(reseeded, CaseResult) and not _same_outputs(ref.outputs, reseeded.outputs):
            return "random: its outputs depend on the RNG seed, so no one-rank reference exists"
        return None

    def digest(self, case: Case) -> str | None:
        """The hash of the case's one-rank outputs (cached with the reference)."""
        ref = self.reference(case.component, case.options)
        return ref.digest if isinstance(ref, CaseResult) else None

    def run(self, case: Case, fixes: tuple[str, ...] = ()) -> Outcome:
        started = time.monotonic()
        ref = self.reference(case.component, case.options)
        assert isinstance(ref, CaseResult), "screened cases have a reference"
        try:
            ranks = self.pools.run(case.layout, run_case, case.component, case.options, fixes, self.typecheck,
                                   impl=impl_of(case.options, case.component))
        except PoolFailure as failure:
            return Outcome.raised(case, failure, seconds=time.monotonic() - started,
                                  reference_digest=self.digest(case), entry=ref.entry)
        outcome = self.judge(case, ranks, ref)
        if not case.options and not fixes:
            self.read_sets[(case.component, str(case.layout))] = frozenset(
                name for r in ranks for name in r.reads)
        outcome.seconds = time.monotonic() - started
        return outcome

    def first_op(self, case: Case, call_gap: CallGap | None = None) -> OpGap | None:
        """The first op whose values part ways with the one-rank run's, for a case that diverges
        with no type rule to explain it: a second pass reruns the case and its one-rank
        reference recording every op megatron-core calls (:func:`first_op_gap`), up to the end
        of ``call_gap``'s call, the case's first diverging contracted call, where it has one;
        where the reference took the whole batch and the ranks share it over dp (each
        micro-batch rebuilt over tp), the first gradient that depends on the split comes first
        (:func:`split_gradient_gap`).
        None when no aligned op that its types rebuild differs there, or a run raised."""
        try:
            ref, ranks = self._recorded(case)
        except PoolFailure:
            return None
        until = next((n for n, call in enumerate(ref.calls) if call_gap is not None
                      and (call.contract, call.index) == (call_gap.contract, call_gap.call)), None)
        dtype, recorded = compute_dtype(case.options), [r.op_calls for r in ranks]
        return (split_gradient_gap(case.layout, recorded, ref.op_calls, dtype)
                or first_op_gap(case.layout, recorded, ref.op_calls, dtype, until))

    def located_violation(self, case: Case, violation: dict) -> dict | None:
        """The checker's ``violation`` of ``case`` as located at its root: itself, or, for one
        the autograd engine raised in a C++ backward node (located at the ``backward`` call), the
        same violation from a rerun that keeps each node's forward traceback (the recorded run's
        anomaly mode), located at the forward line that made the node. None when the rerun
        raised or did not repeat it."""
        if not violation.get("backward"):
            return violation
        try:
            ranks = self._recorded_ranks(case)
        except PoolFailure:
            return None
        same = (violation["rule"], violation["op"], violation["backward"])
        return next((v for rank in ranks for v in rank.violations
                     if (v["rule"], v["op"], v.get("backward")) == same), None)

    def _recorded(self, case: Case) -> tuple[CaseResult, list[CaseResult]]:
        """The case's one-rank reference and its ranks' results, recording megatron-core's ops."""
        impl = impl_of(case.options, case.component)
        ref = self.pools.run(Layout(), run_case, case.component, case.options, (), False, 0, True, impl=impl)[0]
        return ref, self._recorded_ranks(case)

    def _recorded_ranks(self, case: Case) -> list[CaseResult]:
        """The case's ranks' type-checked results, recording megatron-core's ops (anomaly mode)."""
        impl = impl_of(case.options, case.component)
        return self.pools.run(case.layout, run_case, case.component, case.options, (), True, 0, True, impl=impl)

    def judge(self, case: Case, ranks: list[CaseResult], ref: CaseResult) -> Outcome:
        """The case's outcome from its ranks' results against the one-rank reference."""
        dtype = compute_dtype(case.options)
        return Outcome(case, output_gaps([r.outputs for r in ranks], ref.outputs, dtype),
                       first_call_gap(case.layout, [r.calls for r in ranks], ref.calls, dtype),
                       confirmed_across_ranks(r.violations for r in ranks),
                       errors=max_errors([r.outputs for r in ranks], ref.outputs),
                       entry=ranks[0].entry, reference_digest=self.digest(case),
                       ops=op_counts(r.ops for r in ranks),
                       declared={k: v for r in ranks for k, v in r.declared.items()})


def _same_outputs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)
