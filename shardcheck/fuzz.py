"""Search layouts, configurations and inputs for failing examples with hypothesis, and shrink them.

A fuzz target is a name, a hypothesis strategy that draws examples (``{"layout": "tp2", **config}``)
and a check that runs one example and returns a :class:`~shardcheck.trial.Verdict`. Targets come
from :func:`register_fuzz_target` (e.g. Megatron catalogue components, which declare their own
search space) or from a user's ``module:function`` scenario, whose keyword defaults give a search
space when the module registers none.

Shrinking prefers, in this order: fewer ranks (layouts are tried smallest first), smaller sizes
(integers shrink down), and fewer non-default options (:func:`option` shrinks to its default).
Failures are told apart by code location and contract: each distinct one is shrunk on its own.
"""

from __future__ import annotations

import importlib
import inspect
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from shardcheck.findings import DEFAULT_ROOT, Finding, FindingStore
from shardcheck.layout import Layout
from shardcheck.repro import write_repro
from shardcheck.trial import Check, Failure, Verdict, scenario_check, split_example

DEFAULT_LAYOUTS = ("tp2", "dp2", "cp2", "tp2-sp", "tp2-dp2", "tp2-cp2")

FieldSpace = st.SearchStrategy | Callable[[Layout, dict[str, Any]], st.SearchStrategy]


class FuzzError(ValueError):
    """A target that cannot be found or fuzzed; its message is one line for the user."""


@dataclass
class FuzzTarget:
    """What to fuzz: a search space, how to judge an example, and optionally a fix and a repro."""

    name: str
    strategy: st.SearchStrategy[dict[str, Any]]
    check: Check
    fix: Mapping[str, Any] | None = None
    repro: Callable[[Finding], Any] | None = None
    scenario: Callable[..., Any] | None = field(default=None, repr=False)


_TARGETS: dict[str, FuzzTarget] = {}


def register_fuzz_target(name: str, scenario: Callable[..., Any] | None = None,
                         strategy: st.SearchStrategy[dict[str, Any]] | None = None, *,
                         check: Check | None = None, fix: Mapping[str, Any] | None = None,
                         repro: Callable[[Finding], Any] | None = None) -> FuzzTarget:
    """Make ``name`` fuzzable.

    ``scenario(ctx, **config)`` is run by the default check (layout vs. one-rank reference);
    a custom ``check(example) -> Verdict`` replaces it. ``strategy`` draws the examples (see
    :func:`space`). ``fix`` is the config that switches the bug's fix on, for a corrected
    control. ``repro(finding)`` returns the :class:`~shardcheck.repro.ScriptBody` of a
    self-contained reproduction script.
    """
    if strategy is None:
        if scenario is None:
            raise FuzzError(f"fuzz target {name!r} needs a strategy or a scenario to derive one from")
        strategy = signature_space(scenario)
    if check is None:
        if scenario is None:
            raise FuzzError(f"fuzz target {name!r} needs a scenario or a check")
        check = scenario_check(scenario)
    target = FuzzTarget(name, strategy, check, fix, repro, scenario)
    _TARGETS[name] = target
    return target


def registered_targets() -> dict[str, FuzzTarget]:
    """The registered fuzz targets by name."""
    return dict(_TARGETS)


def resolve_target(spec: str | FuzzTarget) -> FuzzTarget:
    """A registered target by name, or the target of a ``module:function`` scenario."""
    if isinstance(spec, FuzzTarget):
        return spec
    if spec in _TARGETS:
        return _TARGETS[spec]
    if ":" not in spec:
        known = ", ".join(sorted(_TARGETS)) or "none registered"
        raise FuzzError(f"unknown fuzz target {spec!r}: give module:function or one of: {known}")
    scenario = _import_scenario(spec)
    for target in _TARGETS.values():
        if target.scenario is scenario:
            return target
    return register_fuzz_target(spec, scenario)


def _import_scenario(spec: str) -> Callable[..., Any]:
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FuzzError(f"cannot import {module_name!r} for scenario {spec!r}: {exc}") from exc
    scenario = getattr(module, function_name, None)
    if not callable(scenario):
        raise FuzzError(f"module {module_name!r} has no function {function_name!r}")
    return scenario


# -- search spaces ---------------------------------------------------------------------------

def option(default: Any, *alternatives: Any) -> st.SearchStrategy:
    """A configuration field that shrinks to ``default``, then to the alternatives in order.

    It is one choice for hypothesis, so a non-default option never makes an example look
    simpler than one with fewer ranks.
    """
    return st.sampled_from([default, *[a for a in alternatives if a != default]])


def layouts(names: Iterable[str | Layout]) -> st.SearchStrategy[str]:
    """Layouts, shrinking towards the fewest ranks (then the order given)."""
    parsed = [Layout.coerce(n) for n in names]
    ordered = sorted(parsed, key=lambda layout: layout.world_size)
    return st.sampled_from([str(layout) for layout in ordered])


def per_rank(axis: str, elements: FieldSpace) -> Callable[[Layout, dict[str, Any]], st.SearchStrategy]:
    """A field holding one value per rank of ``axis`` (e.g. token counts, padding per rank)."""
    def draw_list(layout: Layout, drawn: dict[str, Any]) -> st.SearchStrategy:
        size = layout.size(axis)
        return st.lists(_field(elements, layout, drawn), min_size=size, max_size=size)
    return draw_list


def space(layout_names: Sequence[str | Layout], **fields: FieldSpace) -> st.SearchStrategy[dict[str, Any]]:
    """Examples ``{"layout": ..., **fields}``, drawn in the order given.

    A field is a strategy, or a function ``(layout, drawn_so_far) -> strategy`` for fields that
    depend on the layout or on earlier fields (see :func:`per_rank`).
    """
    layout_strategy = layouts(layout_names)

    @st.composite
    def examples(draw: Callable[[st.SearchStrategy], Any]) -> dict[str, Any]:
        drawn: dict[str, Any] = {"layout": draw(layout_strategy)}
        layout = Layout.parse(drawn["layout"])
        for name, spec in fields.items():
            drawn[name] = draw(_field(spec, layout, drawn))
        return drawn

    return examples()


def _field(spec: FieldSpace, layout: Layout, drawn: dict[str, Any]) -> st.SearchStrategy:
    return spec if isinstance(spec, st.SearchStrategy) else spec(layout, drawn)


def signature_space(scenario: Callable[..., Any],
                    layout_names: Sequence[str] = DEFAULT_LAYOUTS) -> st.SearchStrategy[dict[str, Any]]:
    """A search space from a scenario's keyword defaults: bools flip, ints and floats vary."""
    fields: dict[str, FieldSpace] = {}
    for name, param in inspect.signature(scenario).parameters.items():
        default = param.default
        if isinstance(default, bool):
            fields[name] = option(default, not default)
        elif isinstance(default, int):
            fields[name] = option(default, *range(1, max(2 * default, 4) + 1))
        elif isinstance(default, float):
            fields[name] = option(default, 0.0, 0.1, 0.5)
    return space(layout_names, **fields)


# -- campaigns -------------------------------------------------------------------------------

@dataclass
class Campaign:
    """The outcome of fuzzing one target."""

    target: str
    findings: list[Finding]
    new: list[str]
    examples: int
    seconds: float
    first_failure_at: int | None = None


class _ExampleFailed(Exception):
    """Raised inside the hypothesis test; one subclass per (location, contract)."""

    def __init__(self, example: dict[str, Any], verdict: Verdict) -> None:
        super().__init__(verdict.failure.title if verdict.failure else "failed")
        self.example, self.verdict = example, verdict


def fuzz(spec: str | FuzzTarget, *, budget: int = 50, seed: int | None = None,
         root: Path | str | None = DEFAULT_ROOT, write_repros: bool = True,
         progress: Callable[[int, int], None] | None = None) -> Campaign:
    """Fuzz a target with ``budget`` examples; shrink, store and return each distinct failure.

    ``seed`` makes the search reproducible. With a ``root``, hypothesis keeps its example database
    in ``root/hypothesis/<target>`` (replayed first on the next run) and findings are saved in
    ``root/findings``, with a repro script in ``root/repro`` when the target can write one.
    ``progress(examples_run, failing_examples)`` is called after every example.
    """
    target = resolve_target(spec)
    failure_types: dict[tuple[str, str], type[_ExampleFailed]] = {}
    examples, failing, first_failure_at = 0, 0, None

    def run_example(example: dict[str, Any]) -> None:
        nonlocal examples, failing, first_failure_at
        examples += 1
        verdict = target.check(example)
        failing += verdict.failure is not None
        if progress is not None:
            progress(examples, failing)
        if verdict.failure is not None:
            first_failure_at = first_failure_at or examples
            raise _failure_type(failure_types, verdict.failure.key)(example, verdict)

    test = given(target.strategy)(run_example)
    test = settings(**_settings(target, budget, seed, root))(test)
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    started = time.monotonic()
    failures = _collect_failures(test)
    findings = [_finding(target, failure) for failure in failures]
    new = _store(findings, root, target, write_repros) if root is not None else []
    return Campaign(target.name, findings, new, examples, time.monotonic() - started, first_failure_at)


def _settings(target: FuzzTarget, budget: int, seed: int | None, root: Path | str | None) -> dict[str, Any]:
    database = (DirectoryBasedExampleDatabase(str(Path(root) / "hypothesis" / _slug(target.name)))
                if root is not None else None)
    phases = [Phase.generate, Phase.shrink] + ([Phase.reuse] if database is not None else [])
    return dict(max_examples=budget, database=database, deadline=None, phases=phases,
                derandomize=False, report_multiple_bugs=True, print_blob=False,
                verbosity=Verbosity.quiet, suppress_health_check=list(HealthCheck))


def _failure_type(types: dict[tuple[str, str], type[_ExampleFailed]],
                  key: tuple[str, str]) -> type[_ExampleFailed]:
    """One exception class per failure key, so hypothesis shrinks each distinct bug separately."""
    if key not in types:
        types[key] = type(f"ExampleFailed{len(types)}", (_ExampleFailed,), {})
    return types[key]


def _collect_failures(test: Callable[[], None]) -> list[_ExampleFailed]:
    """Run the hypothesis test; the shrunk failures it raised (several come as a group)."""
    try:
        test()
    except _ExampleFailed as failure:
        return [failure]
    except Exception as group:
        inner = getattr(group, "exceptions", None)
        if inner and all(isinstance(e, _ExampleFailed) for e in inner):
            return sorted(inner, key=lambda e: e.verdict.failure.key)
        raise
    return []


def _finding(target: FuzzTarget, failed: _ExampleFailed) -> Finding:
    failure: Failure = failed.verdict.failure
    layout, config = split_example(failed.example)
    corrected = None
    if target.fix is not None:
        corrected = target.check({**failed.example, **target.fix}).observed
    return Finding(title=failure.title, target=target.name, location=failure.location,
                   contract=failure.contract, layout=layout, config=config,
                   observed=failed.verdict.observed, reference=failed.verdict.reference,
                   corrected=corrected, max_error=failure.max_error, checker=failure.checker)


def _store(findings: list[Finding], root: Path | str, target: FuzzTarget, write_repros: bool) -> list[str]:
    """Save the findings (and their repro scripts); the ids of those not seen before."""
    store, new = FindingStore(root), []
    for finding in findings:
        if write_repros and target.repro is not None:
            finding.repro = str(write_repro(finding, target, Path(root) / "repro" / f"{finding.id}.py"))
        if store.save(finding):
            new.append(finding.id)
    return new


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
