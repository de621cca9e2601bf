"""The Megatron catalogue as fuzz targets: ``shardcheck fuzz moe_router``.

Each component of :data:`~shardcheck.megatron.scenarios.COMPONENTS` is registered under its
name. An example is a layout the component accepts, its setup's own options (padding, masks, label
smoothing, ...), up to two of the ``TransformerConfig`` options the audit sweeps (both found by
introspection, see :mod:`shardcheck.megatron.audit.sweep`), and the input sizes the component's setup
declares fuzzable (``field(metadata={"fuzz": (4, 8, 16)})``). Examples shrink to the fewest
ranks, then the fewest non-default options, then the smallest sizes.

An example is judged as the audit judges a case: the component runs on warm Gloo ranks under the
type checker, and its outputs and contracted calls are compared with the one-rank run; findings
are located and keyed by the same contracts. An example the component cannot run (it fails on
one rank, its outputs depend on the RNG seed, or the scenario refuses the layout) is rejected,
not reported. The declared sizes divide over every layout of up to 4 ranks.
"""

from __future__ import annotations

import atexit
import dataclasses
from functools import partial
from typing import Any

from hypothesis import reject
from hypothesis import strategies as st

from shardcheck.fuzz.campaign import register_fuzz_target
from shardcheck.fuzz.spaces import option
from shardcheck.fuzz.trial import BOTH, NUMERIC, RUN, TYPE, ExampleVerdict, Failure, split_example
from shardcheck.megatron.audit import report as audit_report
from shardcheck.megatron.audit.outcome import Outcome
from shardcheck.megatron.audit.runner import INERT, Pools, Runner
from shardcheck.megatron.audit.sweep import Case, component_options, layouts, setup_options
from shardcheck.megatron.repro.templates import TEMPLATES, script_body
from shardcheck.megatron.scenarios import COMPONENTS
from shardcheck.parity.layout import Layout

MAX_OPTIONS = 2
_runners: list[Runner] = []


def _runner() -> Runner:
    """The runner shared by every example of this process, on warm pools of preloaded ranks."""
    if not _runners:
        _runners.append(Runner(Pools(), typecheck=True))
        atexit.register(_runners[0].pools.close)
    return _runners[0]


def fuzzable_sizes(setup_cls: type) -> dict[str, tuple[int, ...]]:
    """The setup fields that declare the sizes to try (``metadata={"fuzz": sizes}``)."""
    return {f.name: tuple(f.metadata["fuzz"]) for f in dataclasses.fields(setup_cls) if "fuzz" in f.metadata}


def component_space(component: str) -> st.SearchStrategy[dict[str, Any]]:
    """Examples ``{"layout": ..., **setup options, **config options, **sizes}`` of a component.

    The setup's own options (padding, masks, label smoothing, ...) are drawn one field each,
    shrinking to the default; ``TransformerConfig`` options are many, so at most
    :data:`MAX_OPTIONS` of them are drawn, shrinking to none.
    """
    entry = COMPONENTS[component]
    accepted = [str(lay) for lay in layouts() if entry.refuses(lay) is None]
    own = _by_field(setup_options(entry.setup))
    config = [o for o in component_options(component) if o[0] not in own]
    picked = st.lists(st.sampled_from(range(len(config))), max_size=MAX_OPTIONS,
                      unique_by=lambda i: config[i][0]) if config else st.just([])
    fields = {name: option(_default(entry.setup, name), *values) for name, values in own.items()}
    fields.update({name: st.sampled_from(sorted(sizes)) for name, sizes in fuzzable_sizes(entry.setup).items()})

    @st.composite
    def examples(draw) -> dict[str, Any]:
        example: dict[str, Any] = {"layout": draw(st.sampled_from(accepted))}
        example.update(config[i] for i in sorted(draw(picked)))
        drawn = {name: draw(strategy) for name, strategy in fields.items()}
        example.update({name: value for name, value in drawn.items()
                        if name in fuzzable_sizes(entry.setup) or value != _default(entry.setup, name)})
        return example

    return examples()


def _by_field(options: list[tuple[str, Any]]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for name, value in options:
        grouped.setdefault(name, []).append(value)
    return grouped


def _default(setup_cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(setup_cls) if f.name == name)


def check_example(component: str, example: dict[str, Any]) -> ExampleVerdict:
    """Run one example as an audit case and judge it; reject what cannot run."""
    layout_text, config = split_example(example)
    options = tuple(sorted(config.items()))
    runner = _runner()
    why = runner.screen(component, options)
    case = Case(component, options, Layout.parse(layout_text))
    if (why and why != INERT) or runner.other_meaning(case):  # no one-rank truth to compare
        reject()
    outcome = runner.run(case)
    if outcome.error:
        return _error_verdict(outcome)
    if not outcome.failed:
        return ExampleVerdict()
    return _failure_verdict(outcome)


def _error_verdict(outcome: Outcome) -> ExampleVerdict:
    if outcome.refusal:
        reject()
    where = (outcome.frame or outcome.entry or outcome.case.component).split(" in ")[0]  # as the audit's crashes
    return ExampleVerdict(Failure(f"{outcome.case.component} under {outcome.case.layout}: {outcome.error}",
                           where, "runs without raising", kind=RUN))


def _failure_verdict(outcome: Outcome) -> ExampleVerdict:
    located = _located(outcome)
    [(key, members)] = audit_report.group([located]).items()
    violation = audit_report.checker_violation(key[0], [outcome, *members], set())
    checker = violation["line"] if violation else None
    kind = (BOTH if checker else NUMERIC) if outcome.gaps else TYPE
    failure = Failure(audit_report.title(key, outcome), key[0], key[1],
                      max(g.max_error for g in outcome.gaps) if outcome.gaps else None, checker, kind)
    effect = audit_report.effect(outcome, limit=0)
    if not effect:
        return ExampleVerdict(failure)
    name = effect[0]["value"]
    return ExampleVerdict(failure, {name: audit_report.show_number(effect[0]["observed"])},
                   {name: audit_report.show_number(effect[0]["reference"])})


def _located(outcome: Outcome) -> Outcome:
    """The outcome, or, when no contracted call locates its numeric failure (calls are not
    aligned under every layout), the first two-rank run of the same options that locates one,
    so that one bug gives one finding whatever layout the search shrinks to."""
    if not outcome.gaps or outcome.call_gap is not None:
        return outcome
    entry, case = COMPONENTS[outcome.case.component], outcome.case
    for layout in (lay for lay in layouts(max_world=2) if entry.refuses(lay) is None and lay != case.layout):
        other = _runner().run(case.with_layout(layout))
        if other.call_gap is not None and other.gaps:
            return other
    return outcome


def register_catalogue() -> None:
    """Register every catalogue component as a fuzz target under its own name, with the audit's
    repro template of the component (when it has one) for its findings' scripts."""
    for component in COMPONENTS:
        register_fuzz_target(component, strategy=st.deferred(lambda c=component: component_space(c)),
                             check=partial(check_example, component),
                             repro=script_body if component in TEMPLATES else None,
                             options=partial(_option_names, component))


def _option_names(component: str, config: dict[str, Any]) -> list[str]:
    """A trigger's options: every field but the setup's sizes (the audit's trigger options)."""
    sizes = fuzzable_sizes(COMPONENTS[component].setup)
    return sorted(name for name in config if name not in sizes)


register_catalogue()
