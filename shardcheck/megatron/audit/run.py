"""``shardcheck audit``: the type checker and parity over the generic sweep of megatron-core.

For each case of the sweep (:mod:`shardcheck.megatron.audit.sweep`) the component runs on warm Gloo
ranks (one :class:`~shardcheck.parity.pool.RankPool` per world size, since Megatron's
``parallel_state`` spans the whole default group) and on one rank. A case fails when an
output differs from the one-rank run (:mod:`shardcheck.megatron.audit.divergence`); its contracted
calls locate the divergence in megatron-core, and the type checker, when present, gives the
``checker:`` line. Failures are deduplicated into findings by location and contract
(:mod:`shardcheck.megatron.findings`).

A single option is screened on one rank before it is swept: if the component fails with it
there, or its outputs depend on the RNG seed, it is not run under the layouts (it is listed in
the report's coverage section instead). An option that changes none of the one-rank outputs
(a dispatcher choice, an overlap switch) may still change what the ranks exchange, so it is
swept after the options that do change them on the same layout tier, before the plan moves on
to larger layouts, within the same budget.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from shardcheck.megatron.audit import report as audit_report
from shardcheck.megatron.audit.divergence import (
    CallGap,
    Gap,
    compute_dtype,
    first_call_gap,
    max_errors,
    output_gaps,
)
from shardcheck.megatron.audit.rank import CaseResult, run_case
from shardcheck.megatron.audit.report import Finding
from shardcheck.megatron.audit.sweep import Case, changed_config_fields, layout_dependent_fields
from shardcheck.megatron.checks import contracts, explicit
from shardcheck.megatron.checks.typecheck import checker_available
from shardcheck.megatron.cpu.parallel import LayoutUnsupported
from shardcheck.parity.layout import Layout
from shardcheck.parity.pool import PoolFailure, RankPool
from shardcheck.typecheck.checker import confirmed_across_ranks

PRELOAD = ("megatron.core.pipeline_parallel.schedules", "megatron.core.optimizer",
           "megatron.core.transformer.moe.router", "megatron.core.models.gpt.gpt_model",
           "megatron.core.models.T5.t5_model", "megatron.core.models.multimodal.llava_model",
           "shardcheck.megatron.scenarios", "megatron.core.ssm.gated_delta_net")
RUN_TIMEOUT = 30.0
INERT = "changes no output at one rank"
CONFIG_REFUSES = "megatron-core refuses it"
FAILS = "fails on one rank"
LAYOUT_MEANING = ("the config derives its meaning from the parallel sizes, so the one-rank run "
                  "is another computation")


# ---- in the parent ------------------------------------------------------------------------

class Pools:
    """One warm rank pool per world size, started on first use, and the one-rank references
    computed on them (the same megatron-core for the pools' life, so every audit over these
    pools reuses them)."""

    def __init__(self, timeout: float = RUN_TIMEOUT) -> None:
        self.timeout = timeout
        self._pools: dict[int, RankPool] = {}
        self.references: dict[tuple[str, tuple, int], CaseResult | str] = {}

    def run(self, layout: Layout, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if layout.world_size not in self._pools:
            self._pools[layout.world_size] = RankPool(layout.world_size, timeout=self.timeout,
                                                      preload=_importable(PRELOAD))
        return self._pools[layout.world_size].run(layout, fn, *args)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.__exit__(None, None, None)
        self._pools.clear()


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
    error_kind: str | None = None
    entry: str | None = None
    errors: dict[str, float] = field(default_factory=dict)
    reference_digest: str | None = None  # the one-rank outputs' hash: which options change them
    frame: str | None = None  # an error's innermost megatron-core frame
    config_check: bool = False  # megatron-core's check of its arguments raised it
    ops: dict | None = None  # op calls in megatron-core over all ranks: typed, unknown, unknown_at

    @property
    def crashed(self) -> bool:
        """It raised (or hung) under its layout while its one-rank reference ran."""
        return bool(self.error) and self.refusal is None

    @property
    def failed(self) -> bool:
        return bool(self.gaps or self.violations)

    @property
    def refusal(self) -> str | None:
        """Why the scenario (``LayoutUnsupported``) or megatron-core's check of its arguments
        (:func:`_in_config_check`) refused the case on its ranks, else None."""
        if self.error and self.error.split(":")[0].endswith(LayoutUnsupported.__name__):
            return self.error.split(":", 1)[1].strip()
        if self.error and self.config_check:
            return f"{CONFIG_REFUSES}: {self.error}" + (f" ({self.frame})" if self.frame else "")
        return None


_FRAME = re.compile(r'^ +File "([^"]*)", line \d+, in (\S+)', re.MULTILINE)
_MEGATRON = "/megatron/core/"
REFUSED_TYPES = ("AssertionError", "ValueError")  # Python's exceptions for a refused argument
CONSTRUCTORS = ("__init__", "__post_init__")
VALIDATOR = re.compile(r"_?(ensure|validate|check|verify)(_|$)")  # ensure_divisibility, _validate_x


def _megatron_frame(failure: PoolFailure) -> str | None:
    """``file:line in function`` of the innermost megatron-core frame of the first traceback."""
    for text in (failure.tracebacks[rank] for rank in sorted(failure.tracebacks)):
        frames = re.findall(r'File "([^"]*/megatron/core/[^"]*)", line (\d+), in (\S+)', text)
        if frames:
            path, line, function = frames[-1]
            return f"{contracts._short(path)}:{line} in {function}"
    return None


def _raised_type(text: str) -> str:
    """The class name (unqualified) of the exception a traceback ends with."""
    last = list(_FRAME.finditer(text))
    after = text[last[-1].end():] if last else text
    line = next((ln for ln in after.splitlines() if ln and not ln.startswith(" ")), "")
    return line.split(":", 1)[0].rsplit(".", 1)[-1]


def _in_config_check(failure: PoolFailure) -> bool:
    """Whether megatron-core refused its arguments: the error passed through a config's
    ``__post_init__`` (its own check, or a validator it calls), or megatron-core itself raised
    an AssertionError or ValueError in an argument check (:func:`_argument_check`)."""
    whole = failure.tracebacks[min(failure.tracebacks)] if failure.tracebacks else ""
    if re.search(r'File "[^"]*/megatron/core/[^"]*", line \d+, in __post_init__', whole):
        return True
    text = whole.rsplit("Traceback (most recent call last):", 1)[-1]  # the last exception's
    frames = _FRAME.findall(text)
    raised = _raised_type(text)
    return (failure.kind == "error" and bool(frames) and _MEGATRON in frames[-1][0]
            and raised in REFUSED_TYPES and _argument_check(frames, raised))


def _argument_check(frames: list[tuple[str, str]], raised: str) -> bool:
    """Whether the innermost frame, megatron-core's, checks arguments: a constructor; a
    validator (``ensure_divisibility``, ``validate_*``) under a constructor; or, for a
    ValueError, the one megatron-core function the caller called, raising in its own body
    before calling into megatron-core (a schedule refusing its config)."""
    functions = [function for path, function in frames if _MEGATRON in path]
    if functions[-1] in CONSTRUCTORS:
        return True
    if VALIDATOR.match(functions[-1]) and any(f in CONSTRUCTORS for f in functions[:-1]):
        return True
    return raised == "ValueError" and len(functions) == 1


def _first_line(failure: PoolFailure) -> str:
    lines = [ln.strip() for ln in str(failure).splitlines() if ln.strip() and not ln.startswith(" ")]
    errors = [ln for ln in lines if not ln.startswith(("rank ", "last collective", "Traceback"))]
    return (errors[-1] if errors else lines[0] if lines else failure.kind)[:300]


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
                                                      False, rng_offset)[0]
            except PoolFailure as failure:
                self.references[key] = _first_line(failure)
        return self.references[key]

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
            ranks = self.pools.run(case.layout, run_case, case.component, case.options, fixes, self.typecheck)
        except PoolFailure as failure:
            return Outcome(case, error=_first_line(failure), seconds=time.monotonic() - started,
                           error_kind=failure.kind, reference_digest=self.digest(case),
                           frame=_megatron_frame(failure), config_check=_in_config_check(failure),
                           entry=ref.entry)
        dtype = compute_dtype(case.options)
        outcome = Outcome(case, output_gaps([r.outputs for r in ranks], ref.outputs, dtype),
                          first_call_gap(case.layout, [r.calls for r in ranks], ref.calls, dtype),
                          confirmed_across_ranks(r.violations for r in ranks),
                          errors=max_errors([r.outputs for r in ranks], ref.outputs),
                          entry=ranks[0].entry, reference_digest=self.digest(case),
                          ops=op_counts(r.ops for r in ranks))
        if not case.options and not fixes:
            self.read_sets[(case.component, str(case.layout))] = frozenset(
                name for r in ranks for name in r.reads)
        outcome.seconds = time.monotonic() - started
        return outcome


def op_counts(per_rank: Iterable[dict | None]) -> dict | None:
    """The sum of op-call counts (``typed``, ``unknown``, ``unknown_at`` by location); None
    when none was counted (the checker was off)."""
    counted = [c for c in per_rank if c]
    if not counted:
        return None
    unknown_at: dict[str, int] = {}
    for c in counted:
        for location, n in c["unknown_at"].items():
            unknown_at[location] = unknown_at.get(location, 0) + n
    return {"typed": sum(c["typed"] for c in counted), "unknown": sum(c["unknown"] for c in counted),
            "unknown_at": unknown_at}


def typed_share(counts: dict, top: int = 10) -> dict[str, Any]:
    """Counts as the report shows them: the typed share and the most frequent unknown sites."""
    total = counts["typed"] + counts["unknown"]
    worst = sorted(counts["unknown_at"].items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return {"typed": counts["typed"], "calls": total,
            "typed_share": round(counts["typed"] / total, 4) if total else 1.0,
            "unknown_at": [f"{location} ({n})" for location, n in worst]}


def _same_outputs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def _fix_of(minimal: Outcome) -> tuple[str, str] | None:
    """The fix to apply (name, note): explicit groups for a global-group use, else the contract's."""
    if audit_report.global_group_use(minimal) is not None:
        return explicit.FIX, explicit.FIX_NOTE
    if minimal.call_gap is None or contracts.BY_NAME[minimal.call_gap.contract].fix is None:
        return None
    contract = contracts.BY_NAME[minimal.call_gap.contract]
    return contract.name, contract.fix_note


def corrected_control(runner: Runner, minimal: Outcome) -> dict[str, Any] | None:
    """Rerun the minimal trigger with its fix patched in, compared with the reference."""
    fix = _fix_of(minimal)
    if fix is None:
        return None
    fix_name, note = fix
    fixed = runner.run(minimal.case, fixes=(fix_name,))
    if fixed.error:
        return {"fix": note, "result": f"the corrected run failed: {fixed.error}",
                "equal_to_reference": False}
    names = [g.name for g in minimal.gaps]
    errors = {name: fixed.errors.get(name) for name in names}
    worst = max((e for e in errors.values() if e is not None), default=0.0)
    ok = not fixed.gaps and fixed.call_gap is None
    verdict = ("corrected == reference" if ok else
               f"still differs: {', '.join(g.name for g in fixed.gaps[:3])}")
    return {"fix": note, "result": f"{verdict} (max abs error of the diverging outputs "
            f"{worst:.3g} after the fix)", "equal_to_reference": ok, "max_abs_error": worst}


@dataclass
class AuditResult:
    """Everything an audit found and ran."""

    findings: list[Finding]
    outcomes: list[Outcome]
    not_swept: list[str]
    seconds: float
    stopped_early: bool
    not_applicable: list[str] = field(default_factory=list)
    patches: dict[str, str] = field(default_factory=dict)  # CPU patch: applied / not needed
    unavailable: dict[str, str] = field(default_factory=dict)  # component: why it cannot run
    left_out: dict[tuple, str] = field(default_factory=dict)  # (component, options) -> why
    not_read: dict[str, list[str]] = field(default_factory=dict)  # component -> option sets pruned
    pruned: dict[tuple, list[str]] = field(default_factory=dict)  # (component, options) -> layouts

    @property
    def errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]

    @property
    def refused(self) -> list[str]:
        """The entries of ``not_applicable`` that megatron-core's argument checks refused."""
        return [entry for entry in self.not_applicable if f": {CONFIG_REFUSES}: " in entry]

    def summary(self) -> dict[str, Any]:
        ran = [o for o in self.outcomes if not o.error]
        return {
            "cases run": len(ran), "cases failed to run": len(self.errors),
            "options not swept": len(self.not_swept),
            "layouts a component does not support": len(self.not_applicable) - len(self.refused),
            "configurations megatron-core refuses": len(self.refused),
            "cases pruned (options the component's default run never read there)":
                sum(len(lays) for lays in self.pruned.values()),
            "findings": len(self.findings),
            "wall time (s)": round(self.seconds, 1),
            "stopped at the budget or time limit": self.stopped_early,
            "not_swept": self.not_swept,
            "not_applicable": self.not_applicable,  # the refused ones too
            "refused": self.refused,
            "not_read": [f"{c}: {len(sets)} option set(s) never read: {'; '.join(sets)}"
                         for c, sets in self.not_read.items()],
            "cannot run on this version": self.unavailable,
            "cpu patches": self.patches,
            "errors": sorted({f"{o.case.label}: {o.error}" for o in self.errors}),
            "coverage": self.coverage(),
        }

    def coverage(self) -> dict[str, dict[str, Any]]:
        """Per component: the layouts it ran under (plain, explicit groups), the option sets
        run and left out, the options pruned as never read, the cases, and (type-checked) the
        share of megatron-core's op calls that got a type, per layout."""
        table: dict[str, dict[str, Any]] = {}
        components = sorted({o.case.component for o in self.outcomes} | {c for c, _ in self.left_out}
                            | set(self.not_read))
        for component in components:
            ran = [o for o in self.outcomes if o.case.component == component]
            layouts = sorted({o.case.layout for o in ran if not o.error},
                             key=lambda lay: (lay.world_size, str(lay)))
            table[component] = {
                "plain_layouts": [str(lay) for lay in layouts if not lay.explicit_groups],
                "explicit_layouts": [str(lay) for lay in layouts if lay.explicit_groups],
                "option_sets_run": len({o.case.options for o in ran}),
                "option_sets_left_out": sum(1 for c, _ in self.left_out if c == component),
                "options_not_read": len(self.not_read.get(component, [])),
                "cases_pruned": sum(len(lays) for (c, _), lays in self.pruned.items() if c == component),
                "cases": len(ran)}
            ops = _megatron_ops(ran)
            if ops:
                table[component]["megatron_ops"] = ops
        return table


def _megatron_ops(outcomes: list[Outcome]) -> dict[str, Any]:
    """The op calls megatron-core made in these cases: in all, and per layout."""
    counted = [o for o in outcomes if o.ops]
    if not counted:
        return {}
    layouts = sorted({o.case.layout for o in counted}, key=lambda lay: (lay.world_size, str(lay)))
    by_layout = {str(lay): typed_share(op_counts(o.ops for o in counted if o.case.layout == lay))
                 for lay in layouts}
    return {**typed_share(op_counts(o.ops for o in counted), top=0), "by_layout": by_layout}


Progress = Callable[[Case, int], None]


def audit(cases: Iterable[Case], *, budget: int | None = None, time_limit: float | None = None,
          typecheck: bool = True, progress: Progress | None = None,
          run_pools: Pools | None = None, prune: bool = True,
          unbuilt: Mapping[tuple, str] | None = None) -> AuditResult:
    """Run the cases (screening options on one rank first, pruning the cases whose options
    the component's default run under the layout never read), then build the findings.
    ``unbuilt`` (``(component, options) -> why``, the plan's options whose config does not
    build) are listed as not swept."""
    started = time.monotonic()
    with nullcontext(run_pools) if run_pools else pools() as owned:
        patches = owned.run(Layout(), cpu_patch_status)[0]
        runner = Runner(owned, typecheck and checker_available())
        runner.prune = prune
        swept = _sweep(runner, cases, budget, time_limit, progress, started)
        swept.not_swept.update(unbuilt or {})
        findings = _findings(runner, swept.outcomes)
    return _result(findings, swept.outcomes, swept.not_swept, swept.not_applicable.values(), swept.pruned,
                   time.monotonic() - started, swept.stopped_early, patches)


def _result(findings: list[Finding], outcomes: list[Outcome], not_swept: dict[tuple, str],
            not_applicable: Iterable[str], pruned: dict[tuple, list[str]], seconds: float,
            stopped_early: bool, patches: dict[str, str]) -> AuditResult:
    unavailable = {component: why for (component, options), why in not_swept.items()
                   if not options and why.startswith(FAILS)}
    return AuditResult(findings, outcomes, _listed(not_swept), seconds, stopped_early,
                       sorted(not_applicable), patches, unavailable, dict(not_swept),
                       _never_read(outcomes, not_swept, pruned), dict(pruned))


def merge_shares(dirs: Iterable[Any], *, typecheck: bool = True, run_pools: Pools | None = None) -> AuditResult:
    """The audit the shares in ``dirs`` make together (:mod:`shardcheck.megatron.audit.shards`):
    the same findings one run of the whole plan gives; each corrected control is rerun here."""
    from shardcheck.megatron.audit.shards import load_shares, merged

    share = merged(load_shares(list(dirs)))
    with nullcontext(run_pools) if run_pools else pools() as owned:
        findings = _findings(Runner(owned, typecheck and checker_available()), share.outcomes)
    return _result(findings, share.outcomes, share.not_swept, share.not_applicable, share.pruned,
                   share.seconds, share.stopped_early, share.patches)


def _never_read(outcomes: list[Outcome], not_swept: dict[tuple, str],
                pruned: dict[tuple, list[str]]) -> dict[str, list[str]]:
    """Per component, the option sets pruned under every layout they came up under."""
    ran = {(o.case.component, o.case.options) for o in outcomes}
    found: dict[str, list[str]] = {}
    for component, options in sorted(pruned, key=repr):
        if (component, options) not in ran and (component, options) not in not_swept:
            found.setdefault(component, []).append(", ".join(f"{k}={v}" for k, v in options))
    return found


@dataclass
class _Swept:
    outcomes: list[Outcome] = field(default_factory=list)
    not_swept: dict[tuple, str] = field(default_factory=dict)
    not_applicable: dict[tuple, str] = field(default_factory=dict)
    broken: set[tuple[str, str]] = field(default_factory=set)
    inert: list[Case] = field(default_factory=list)
    done_inert: list[Case] = field(default_factory=list)
    stopped_early: bool = False
    pruned: dict[tuple, list[str]] = field(default_factory=dict)  # (component, options) -> layouts


def _refusal(case: Case) -> str | None:
    from shardcheck.megatron.scenarios import COMPONENTS

    return COMPONENTS[case.component].refuses(case.layout)


def _sweep(runner: Runner, cases: Iterable[Case], budget: int | None, time_limit: float | None,
           progress: Progress | None, started: float) -> _Swept:
    """Run the cases in order; an inert option's cases wait until the plan moves on to larger
    layouts (or ends), so they run before the options of larger layouts, within the budget."""
    swept = _Swept()

    def attempt(case: Case, defer_inert: bool) -> bool:
        if (budget is not None and len(swept.outcomes) >= budget) or (
                time_limit is not None and time.monotonic() - started > time_limit):
            swept.stopped_early = True
            return False
        if _runnable(runner, swept, case, defer_inert):
            if progress:
                progress(case, len(swept.outcomes))
            _record(swept, runner.run(case))
        return True

    planned = list(cases)
    reached = 0
    for case in planned:
        waiting = _inert_below(swept, case.layout.world_size) if case.options else []
        if not all(attempt(deferred, False) for deferred in waiting) or not attempt(case, True):
            break
        reached += 1
    else:
        all(attempt(deferred, False) for deferred in _inert_below(swept, None))
    if swept.stopped_early:
        _note_unreached(runner, swept, planned[reached:])
    return swept


def _note_unreached(runner: Runner, swept: _Swept, unreached: list[Case]) -> None:
    """Option sets the budget or time limit left without a single case, with the count of
    their cases that would have run (not refused, not pruned)."""
    ran = {(o.case.component, o.case.options) for o in swept.outcomes}
    for case in (c for c in swept.inert + swept.done_inert if (c.component, c.options) not in ran):
        swept.not_swept.setdefault((case.component, case.options),
                                   f"{INERT}; its multi-rank cases were not reached in the budget")
    left: dict[tuple, int] = {}
    for case in unreached:
        key = (case.component, case.options)
        if (key not in ran and key not in swept.not_swept and _refusal(case) is None
                and (case.component, str(case.layout)) not in swept.broken and runner.not_read(case) is None
                and runner.other_meaning(case) is None):
            left[key] = left.get(key, 0) + 1
    for key, count in left.items():
        swept.not_swept[key] = f"not reached within the budget or time limit ({count} case(s) left)"


def _inert_below(swept: _Swept, world_size: int | None) -> list[Case]:
    """Take the deferred cases of inert options on layouts smaller than ``world_size`` (all: None)."""
    taken = [c for c in swept.inert if world_size is None or c.layout.world_size < world_size]
    swept.inert = [c for c in swept.inert if c not in taken]
    swept.done_inert += taken
    return taken


def _runnable(runner: Runner, swept: _Swept, case: Case, defer_inert: bool) -> bool:
    """Whether to run the case now (screening its option once); inert options wait."""
    key, where = (case.component, case.options), (case.component, str(case.layout))
    if where in swept.not_applicable or where in swept.broken:
        return False
    if why := _refusal(case):
        swept.not_applicable[where] = f"{case.component} @ {case.layout}: {why}"
        return False
    if key in swept.not_swept:
        return False
    if why := runner.other_meaning(case):
        swept.not_applicable[(case.component, str(case.layout), case.options)] = f"{case.label}: {why}"
        return False
    if runner.not_read(case) is not None:
        swept.pruned.setdefault(key, []).append(str(case.layout))
        return False
    why = runner.screen(*key)
    if why and why != INERT:
        swept.not_swept[key] = why
        return False
    if defer_inert and why == INERT:
        swept.inert.append(case)
        return False
    return True


def _record(swept: _Swept, outcome: Outcome) -> None:
    """Keep an outcome; a layout the component refuses is noted as such, not as an error (a
    config's refusal of an option under the layout closes that option there, not the layout)."""
    case = outcome.case
    if why := outcome.refusal:
        if case.options and why.startswith(CONFIG_REFUSES):
            swept.not_applicable[(case.component, str(case.layout), case.options)] = (
                f"{case.label}: {why}")
        else:
            swept.not_applicable[(case.component, str(case.layout))] = f"{case.component} @ {case.layout}: {why}"
        return
    swept.outcomes.append(outcome)
    if outcome.error and not case.options:
        swept.broken.add((case.component, str(case.layout)))
    elif outcome.error_kind in ("hang", "desync"):
        swept.not_swept[(case.component, case.options)] = (
            f"{outcome.error_kind} under {case.layout}; not swept further")


def _listed(not_swept: dict[tuple, str]) -> list[str]:
    return [f"{component} {dict(options) or 'defaults'}: {why}"
            for (component, options), why in sorted(not_swept.items(), key=repr)]


def _findings(runner: Runner, outcomes: list[Outcome]) -> list[Finding]:
    """One finding per root cause: failing cases grouped by place, split by trigger
    (:func:`audit_report.causes`); independent triggers that one fix repairs are one cause."""
    baseline = {(o.case.component, o.case.layout): {audit_report.violation_key(v) for v in o.violations}
                for o in outcomes if not o.case.options}
    outcomes = sorted(outcomes, key=lambda o: (o.case.component, audit_report.case_size(o.case),
                                               repr(o.case.options)))
    findings = []
    for key, members in audit_report.group([o for o in outcomes if o.failed]).items():
        built = [_finding(runner, key, cause, baseline, first=n == 0)
                 for n, cause in enumerate(audit_report.causes(members))]
        findings += _merged_by_fix(built)
    findings += [_crash_finding(key, cause, first=n == 0)
                 for key, members in _crashes(outcomes).items()
                 for n, cause in enumerate(audit_report.causes(members))]
    return sorted(findings, key=lambda f: (f.kind, f.location, f.id))


def _finding(runner: Runner, key: tuple[str, str], members: list[Outcome],
             baseline: dict, first: bool) -> Finding:
    minimal = audit_report.minimal_case(members)
    seen = baseline.get((minimal.case.component, minimal.case.layout), set())
    checker = audit_report.checker_line(key[0], [minimal, *members], seen if minimal.case.options else set())
    return Finding(
        title=audit_report.title(key, minimal), kind=audit_report.kind(members, checker),
        location=key[0], contract=key[1], trigger=audit_report.trigger(minimal.case),
        effect=audit_report.effect(minimal),
        first_divergence=minimal.call_gap.gap.summary() if minimal.call_gap else None,
        checker=checker, corrected=corrected_control(runner, minimal),
        reproduce=audit_report.reproduce_command(minimal.case),
        seen_in=audit_report.seen_in(members, minimal),
        cases=[audit_report.case_entry(o.case) for o in members],
        id="" if first else _trigger_id(key, minimal.case))


def _trigger_id(key: tuple[str, str], case: Case) -> str:
    """The id of a second cause at one place: its trigger's option names join the hash."""
    from shardcheck.fuzz.findings import finding_id

    return finding_id(key[0], "\0".join([key[1], *sorted(name for name, _ in case.options)]))


def _merged_by_fix(found: list[Finding]) -> list[Finding]:
    """Causes at one place whose triggers are independent but which the same corrected function
    repairs (each corrected control equals the reference) are one: the first keeps the others'
    triggers and cases under ``same_fix``."""
    host: Finding | None = None
    kept = []
    for finding in found:
        repaired = bool(finding.corrected and finding.corrected["equal_to_reference"])
        if repaired and host is not None and finding.corrected["fix"] == host.corrected["fix"]:
            host.same_fix.append({**finding.trigger, "cases": finding.cases,
                                  "corrected": finding.corrected["result"]})
            layouts = sorted({c["layout"] for c in finding.cases})
            host.seen_in.append(f"the same fix repairs the independent trigger "
                                f"{_options_text(finding.trigger)} (under {', '.join(layouts)})")
            continue
        if repaired and host is None:
            host = finding
        kept.append(finding)
    return kept


def _options_text(trigger: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in trigger["options"].items()) or "defaults"


CRASH_CONTRACT = "runs under the layout as it runs on one rank"


def _crashes(outcomes: list[Outcome]) -> dict[tuple[str, str], list[Outcome]]:
    """Cases that raised or hung under their layout while one rank runs them, by place: their
    innermost megatron-core frame and exception type (else the component's entry point)."""
    found: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in (o for o in outcomes if o.crashed and o.reference_digest is not None):
        where = outcome.frame or outcome.entry or f"{outcome.case.component} (no megatron-core frame)"
        what = outcome.error.split(":", 1)[0] if outcome.error_kind == "error" else outcome.error_kind
        found.setdefault((where.split(" in ")[0], f"{CRASH_CONTRACT} ({what})"), []).append(outcome)
    return found


def _crash_finding(key: tuple[str, str], members: list[Outcome], first: bool) -> Finding:
    minimal = audit_report.minimal_case(members)
    case = minimal.case
    return Finding(
        title=f"{case.component} {minimal.error_kind} under {case.layout} "
              f"({_options_text(audit_report.trigger(case))}): {minimal.error}"[:240],
        kind="crash", location=key[0], contract=key[1], trigger=audit_report.trigger(case),
        effect=[], first_divergence=None, checker=None, corrected=None,
        reproduce=audit_report.reproduce_command(case), seen_in=audit_report.seen_in(members, minimal),
        cases=[audit_report.case_entry(o.case) for o in members],
        id="" if first else _trigger_id(key, case),
        one_rank=f"{minimal.error} (frame {minimal.frame or 'outside megatron-core'}); "
                 f"the same component and options run on one rank")
