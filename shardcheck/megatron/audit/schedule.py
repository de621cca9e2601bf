"""The order an audit runs its cases in, and what it leaves out.

A single option is screened on one rank before it is swept: if the component fails with it
there, or its outputs depend on the RNG seed, it is not run under the layouts (it is listed in
the report's coverage section instead). An option that changes none of the one-rank outputs
(a dispatcher choice, an overlap switch) may still change what the ranks exchange, so it is
swept after the options that do change them on the same layout tier, before the plan moves on
to larger layouts, within the same budget. A layout the component refuses, or whose defaults
fail, is not tried with options; a case whose options the defaults never read is pruned.

The default plan is a selection of the whole plan (:func:`in_default_plan`): each component's
defaults under every layout, its defaults and a few option sets on Transformer Engine
(:func:`~shardcheck.megatron.audit.sweep.te_cases`), each option set under the
cheapest layout of each parallel dimension the component runs under (:data:`OPTION_LAYOUTS`:
tp2, or tp2-sp where tp needs sp; cp2; dp2; dp2-ep2; pp2), and each option set of the scenario's
own classes (its setup fields and inputs, the model's arguments, bundles) under one
explicit-group layout (:data:`EXPLICIT_LAYOUTS`), where a collective on a global group instead
of the model's shows. An option set that none of those runs (pruned there, or refused) runs at
its first larger layout in plan order that it is not pruned at (not an expert-tp one, whose
options are all left to --full), so every option runs where it matters, if anywhere. The other cases are *left to --full*: counted per option set and reported
with the command that runs them, never dropped silently (``shardcheck audit --full`` runs the
whole plan).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shardcheck.megatron.audit.outcome import CANNOT_RUN_HERE, CONFIG_REFUSES, Outcome
from shardcheck.megatron.audit.runner import INERT, Runner
from shardcheck.megatron.audit.sweep import Case, in_te_tier
from shardcheck.parity.layout import Layout

Progress = Callable[[Case, int], None]
# The default plan sweeps options under the first layout of each class the component runs under
# (the MoE components need sp with tp) ...
OPTION_LAYOUTS = (("tp2", "tp2-sp"), ("cp2",), ("dp2",), ("dp2-ep2",), ("pp2",))
# ... and the scenario's own option classes under the first of these: tp and dp groups both in
# another rank order than parallel_state's
EXPLICIT_LAYOUTS = ("tp2-dp2@dp-tp", "tp2-dp2-sp@dp-tp")
NOT_REACHED = "not reached within the budget or time limit"


def in_default_plan(case: Case) -> bool:
    """Whether the default plan runs the case whatever else ran: a component's defaults (every
    layout, or those of its ``default_layouts`` slice, which runs nothing else), the TE tier (its defaults and TE's option sets on Transformer Engine), an option set under one of the
    component's :func:`option_layouts`, or an option set of the scenario's own classes under its
    :func:`explicit_layout`. (An option set none of those runs also runs at its first larger
    layout that is not pruned, see :func:`sweep`.)"""
    if in_te_tier(case):
        return True
    name, sliced = str(case.layout), _default_layouts(case.component)
    if sliced is not None:
        return not case.options and name in sliced
    if not case.options:
        return True
    return name in option_layouts(case.component) or (
        name == explicit_layout(case.component) and _scenario_class(case))


def _default_layouts(component: str) -> tuple[str, ...] | None:
    from shardcheck.megatron.scenarios import COMPONENTS

    return COMPONENTS[component].default_layouts


def _scenario_class(case: Case) -> bool:
    """Whether the case's options are of the scenario's own classes: a setup field (an input
    among them), a model argument, or a bundle; not one field of the TransformerConfig sweep."""
    from shardcheck.megatron.audit.sweep import model_argument
    from shardcheck.megatron.scenarios import COMPONENTS

    [(name, _), *more] = case.options
    own = {f.name for f in dataclasses.fields(COMPONENTS[case.component].setup)}
    return bool(more) or name in own or model_argument(name) is not None


@functools.cache
def option_layouts(component: str) -> tuple[str, ...]:
    """The first layout of each class of :data:`OPTION_LAYOUTS` the component runs under."""
    return tuple(name for name in (_first_run(component, names) for names in OPTION_LAYOUTS) if name)


@functools.cache
def explicit_layout(component: str) -> str | None:
    """The first of :data:`EXPLICIT_LAYOUTS` the component runs under (None: none)."""
    return _first_run(component, EXPLICIT_LAYOUTS)


def _first_run(component: str, names: tuple[str, ...]) -> str | None:
    from shardcheck.megatron.audit.sweep import runs_under

    return next((name for name in names if runs_under(component, Layout.parse(name))
                 and _refusal(Case(component, (), Layout.parse(name))) is None), None)


@dataclass
class Swept:
    """What the sweep ran, and what it left out and why."""

    outcomes: list[Outcome] = field(default_factory=list)
    not_swept: dict[tuple, str] = field(default_factory=dict)
    not_applicable: dict[tuple, str] = field(default_factory=dict)
    broken: set[tuple[str, str]] = field(default_factory=set)
    inert: list[Case] = field(default_factory=list)
    done_inert: list[Case] = field(default_factory=list)
    stopped_early: bool = False
    pruned: dict[tuple, list[str]] = field(default_factory=dict)  # (component, options) -> layouts
    left_to_full: dict[tuple, int] = field(default_factory=dict)  # (component, options) -> cases
    unreached: dict[tuple, list[str]] = field(default_factory=dict)  # (component, options) -> layouts
    ran: set[tuple] = field(default_factory=set)  # (component, options) of the outcomes


def _refusal(case: Case) -> str | None:
    from shardcheck.megatron.scenarios import COMPONENTS

    return COMPONENTS[case.component].refuses(case.layout)


def sweep(runner: Runner, cases: Iterable[Case], budget: int | None, time_limit: float | None,
          progress: Progress | None, started: float, full: bool = True) -> Swept:
    """Run the cases in order; an inert option's cases wait until the plan moves on to larger
    layouts (or ends), so they run before the options of larger layouts, within the budget.
    Without ``full`` only the default plan runs (:func:`in_default_plan`, and an option set's
    first larger layout when none ran it before); its other cases are counted as left to --full."""
    swept = Swept()

    def attempt(case: Case, defer_inert: bool) -> bool:
        if (budget is not None and len(swept.outcomes) >= budget) or (
                time_limit is not None and time.monotonic() - started > time_limit):
            swept.stopped_early = True
            return False
        if _runnable(runner, swept, case, defer_inert):
            if progress:
                progress(case, len(swept.outcomes))
            record(swept, runner.run(case))
        return True

    planned: list[Case] = list(cases)
    beyond: list[Case] = []
    reached = 0
    for case in planned:
        waiting = _inert_below(swept, case.layout.world_size) if case.options else []
        if not all(attempt(deferred, False) for deferred in waiting):
            break
        if full or in_default_plan(case) or _first_chance(swept, case):
            if not attempt(case, True):
                break
        else:
            beyond.append(case)
        reached += 1
    else:
        all(attempt(deferred, False) for deferred in _inert_below(swept, None))
    unreached = planned[reached:]
    if not full:
        beyond += [c for c in unreached if not in_default_plan(c) and _left_to_full(swept, c)]
        unreached = [c for c in unreached if in_default_plan(c) or not _left_to_full(swept, c)]
    if swept.stopped_early:
        _note_unreached(runner, swept, unreached)
    _note_left_to_full(runner, swept, beyond)
    return swept


def _has_run(swept: Swept, case: Case) -> bool:
    """Whether a case of the case's option set has run (one that failed to run counts)."""
    return (case.component, case.options) in swept.ran


def _left_to_full(swept: Swept, case: Case) -> bool:
    """Whether a case outside the default plan is left to --full once the plan ends: its option
    set ran, or its component's default plan is a slice (``Component.default_layouts``)."""
    return _has_run(swept, case) or _default_layouts(case.component) is not None


def _first_chance(swept: Swept, case: Case) -> bool:
    """Whether an option set the default plan has not run yet runs here, the first layout it
    reaches, for a component without a default-plan slice. The expert-tp layouts (``etp``) run
    only the defaults in the default plan: their options are left to --full."""
    return _default_layouts(case.component) is None and case.layout.etp is None and not _taken(swept, case)


def _taken(swept: Swept, case: Case) -> bool:
    """Whether the case's option set has run or waits to run (an inert option's deferred case)."""
    key = (case.component, case.options)
    return key in swept.ran or any((c.component, c.options) == key for c in swept.inert)


def _would_run(runner: Runner, swept: Swept, case: Case) -> bool:
    """Whether the case would run if reached: the component runs under its layout and its
    defaults there did not fail, its options were not screened out, and it is not pruned."""
    where = (case.component, str(case.layout))
    return (where not in swept.not_applicable and where not in swept.broken
            and (case.component, case.options) not in swept.not_swept and _refusal(case) is None
            and runner.not_read(case) is None and runner.other_meaning(case) is None)


def _note_unreached(runner: Runner, swept: Swept, unreached: list[Case]) -> None:
    """Option sets the budget or time limit left without a single case, with the count of
    their cases that would have run (not refused, not pruned); and, per option set that ran
    elsewhere, the layouts of its cases left unrun (an inert option's deferred ones among them)."""
    for case in (c for c in swept.inert + swept.done_inert if not _has_run(swept, c)):
        swept.not_swept.setdefault((case.component, case.options),
                                   f"{INERT}; its multi-rank cases were not reached in the budget")
    left: dict[tuple, int] = {}
    done = {(o.case.component, o.case.options, str(o.case.layout)) for o in swept.outcomes}
    for case in unreached + swept.inert + swept.done_inert:
        key = (case.component, case.options)
        if (*key, str(case.layout)) in done or not _would_run(runner, swept, case):
            continue
        if not _has_run(swept, case):
            left[key] = left.get(key, 0) + 1
        elif str(case.layout) not in swept.unreached.setdefault(key, []):
            swept.unreached[key].append(str(case.layout))
    for key, count in left.items():
        swept.not_swept[key] = f"{NOT_REACHED} ({count} case(s) left)"


def _note_left_to_full(runner: Runner, swept: Swept, beyond: list[Case]) -> None:
    """Count, per option set, the cases outside the default plan that ``--full`` would run."""
    for case in beyond:
        if _would_run(runner, swept, case):
            key = (case.component, case.options)
            swept.left_to_full[key] = swept.left_to_full.get(key, 0) + 1


def _inert_below(swept: Swept, world_size: int | None) -> list[Case]:
    """Take the deferred cases of inert options on layouts smaller than ``world_size`` (all: None)."""
    taken = [c for c in swept.inert if world_size is None or c.layout.world_size < world_size]
    swept.inert = [c for c in swept.inert if c not in taken]
    swept.done_inert += taken
    return taken


def _runnable(runner: Runner, swept: Swept, case: Case, defer_inert: bool) -> bool:
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


def record(swept: Swept, outcome: Outcome) -> None:
    """Keep an outcome; a layout the component refuses is noted as such, not as an error (a
    config's refusal of an option under the layout closes that option there, not the layout); an
    option that fails for want of code this machine lacks is listed as not swept."""
    case = outcome.case
    if outcome.missing_code:  # an option this machine cannot run: listed as not swept
        swept.not_swept[(case.component, case.options)] = f"{CANNOT_RUN_HERE} under {case.layout}: {outcome.error}"
        return
    if why := outcome.refusal:
        if case.options and why.startswith(CONFIG_REFUSES):
            swept.not_applicable[(case.component, str(case.layout), case.options)] = (
                f"{case.label}: {why}")
        else:
            swept.not_applicable[(case.component, str(case.layout))] = f"{case.component} @ {case.layout}: {why}"
        return
    swept.outcomes.append(outcome)
    swept.ran.add((case.component, case.options))
    if outcome.error and not case.options:
        swept.broken.add((case.component, str(case.layout)))
    elif outcome.error_kind in ("hang", "desync"):
        swept.not_swept[(case.component, case.options)] = (
            f"{outcome.error_kind} under {case.layout}; not swept further")
