"""Search layouts, configurations and inputs for failing examples with hypothesis, and shrink them.

A fuzz target is a name, a hypothesis strategy that draws examples (``{"layout": "tp2", **config}``)
and a check that runs one example and returns a :class:`~shardcheck.fuzz.trial.ExampleVerdict`. Targets come
from :func:`register_fuzz_target` (e.g. Megatron catalogue components, which declare their own
search space) or from a user's ``module:function`` scenario, whose keyword defaults give a search
space when the module registers none.

Search spaces come from :mod:`shardcheck.fuzz.spaces`. Failures are told apart by code location and
contract: each distinct one is shrunk on its own.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from shardcheck.fuzz.findings import DEFAULT_ROOT, TYPE_ONLY, Finding, FindingStore
from shardcheck.fuzz.repro import ReproError, write_script
from shardcheck.fuzz.spaces import option_names, signature_space
from shardcheck.fuzz.trial import (
    Check,
    ExampleVerdict,
    Failure,
    MakeScenario,
    Measure,
    scenario_check,
    scenario_measure,
    split_example,
)


class FuzzError(ValueError):
    """A target that cannot be found or fuzzed; its message is one line for the user."""


@dataclass
class FuzzTarget:
    """What to fuzz: a search space, how to judge and measure an example, a fix and a repro."""

    name: str
    strategy: st.SearchStrategy[dict[str, Any]]
    check: Check
    measure: Measure | None = None
    fix: Mapping[str, Any] | None = None
    repro: Callable[[Finding], Any] | None = None
    scenario: Callable[..., Any] | None = field(default=None, repr=False)
    module: str | None = None  # importing it registers this target again (in a new process)
    options: Callable[[Mapping[str, Any]], list[str]] | None = field(default=None, repr=False)

    def option_names(self, config: Mapping[str, Any]) -> list[str]:
        """The names of a trigger's options, part of its finding's id (sizes are not options)."""
        return self.options(config) if self.options is not None else option_names(config, self.scenario)

    def write_repro(self, finding: Finding, path: Path | str) -> Path:
        """Write ``finding``'s script, from this target's repro hook, to ``path``."""
        if self.repro is None:
            raise ReproError(f"fuzz target {self.name!r} provides no repro script body "
                             "(register it with repro=...)")
        return write_script(finding, self.repro, path)


_TARGETS: dict[str, FuzzTarget] = {}


def register_fuzz_target(name: str, scenario: Callable[..., Any] | None = None,
                         strategy: st.SearchStrategy[dict[str, Any]] | None = None, *,
                         make_scenario: MakeScenario | None = None, check: Check | None = None,
                         fix: Mapping[str, Any] | None = None,
                         repro: Callable[[Finding], Any] | None = None,
                         typecheck: bool = True,
                         options: Callable[[Mapping[str, Any]], list[str]] | None = None) -> FuzzTarget:
    """Make ``name`` fuzzable, with its own search space.

    The scenario of an example ``{"layout": ..., **config}`` is ``scenario(ctx, **config)``, or
    ``make_scenario(**config)`` (a picklable ``ctx -> outputs``, e.g. a Megatron component with
    options). It runs through parity and the type checker on the warm rank pool; a custom
    ``check(example) -> ExampleVerdict`` replaces that. ``strategy`` draws the examples (see
    :func:`space`; by default from ``scenario``'s keyword defaults). ``fix`` is the config that
    switches the bug's fix on, for a corrected control. ``repro(finding)`` returns the
    :class:`~shardcheck.fuzz.repro.ScriptBody` of a self-contained reproduction script.
    ``typecheck=False`` runs parity alone, for code whose inputs carry no declared types.
    ``options(config)`` names a trigger's options (by default: those set away from the scenario's
    keyword defaults, sizes aside); with the location and contract they make a finding's id.
    """
    if make_scenario is None and scenario is not None:
        make_scenario = partial(partial, scenario)
    if strategy is None:
        if scenario is None:
            raise FuzzError(f"fuzz target {name!r} needs a strategy or a scenario to derive one from")
        strategy = signature_space(scenario)
    measure = None
    if check is None:
        if make_scenario is None:
            raise FuzzError(f"fuzz target {name!r} needs a scenario, make_scenario or a check")
        check, measure = scenario_check(make_scenario, name, typecheck), scenario_measure(make_scenario)
    module = sys._getframe(1).f_globals.get("__name__")
    target = FuzzTarget(name, strategy, check, measure, fix, repro, scenario, module, options)
    _TARGETS[name] = target
    return target


# Registering modules that moved: a stored finding names the module its target was registered from.
MOVED_MODULES = {"shardcheck.megatron.audit.fuzz_targets": "shardcheck.megatron.fuzz_targets"}


def registered_targets() -> dict[str, FuzzTarget]:
    """The registered fuzz targets by name."""
    return dict(_TARGETS)


def resolve_target(spec: str | FuzzTarget, typecheck: bool = True, module: str | None = None) -> FuzzTarget:
    """A registered target by name, or the target of a ``module:function`` scenario.

    ``module`` is imported first when the name is not registered yet (see
    :attr:`Finding.module`). ``typecheck`` applies to a scenario its module did not register.
    """
    if isinstance(spec, FuzzTarget):
        return spec
    if spec not in _TARGETS and module:
        _import(module, spec)
    if spec in _TARGETS:
        return _TARGETS[spec]
    if ":" not in spec:
        known = ", ".join(sorted(_TARGETS)) or "none registered"
        raise FuzzError(f"unknown fuzz target {spec!r}: give module:function or one of: {known}")
    scenario = _import_scenario(spec)
    for target in _TARGETS.values():
        if target.scenario is scenario:
            return target
    return register_fuzz_target(spec, scenario, typecheck=typecheck)


def _import(module_name: str, spec: str) -> Any:
    try:
        return importlib.import_module(MOVED_MODULES.get(module_name, module_name))
    except ImportError as exc:
        raise FuzzError(f"cannot import {module_name!r} for scenario {spec!r}: {exc}") from exc


def _import_scenario(spec: str) -> Callable[..., Any]:
    module_name, _, function_name = spec.partition(":")
    module = _import(module_name, spec)
    scenario = getattr(module, function_name, None)
    if not callable(scenario):
        raise FuzzError(f"module {module_name!r} has no function {function_name!r}")
    return scenario


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
    """Raised inside the hypothesis test; one subclass per search key (see Failure.search_key)."""

    def __init__(self, example: dict[str, Any], verdict: ExampleVerdict) -> None:
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
    failure_types: dict[tuple, type[_ExampleFailed]] = {}
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
            raise _failure_type(failure_types, verdict.failure.search_key)(example, verdict)

    test = given(target.strategy)(run_example)
    if seed is not None:  # before the settings: hypothesis_seed alone would drop the database
        test = hypothesis_seed(seed)(test)
    test = settings(**_settings(target, budget, root))(test)
    started = time.monotonic()
    failures = _collect_failures(test)
    findings = [_finding(target, failure) for failure in _one_per_key(failures)]
    new = _store(findings, root, target, write_repros) if root is not None else []
    return Campaign(target.name, findings, new, examples, time.monotonic() - started, first_failure_at)


def _settings(target: FuzzTarget, budget: int, root: Path | str | None) -> dict[str, Any]:
    database = (DirectoryBasedExampleDatabase(str(Path(root) / "hypothesis" / _slug(target.name)))
                if root is not None else None)
    phases = [Phase.generate, Phase.shrink] + ([Phase.reuse] if database is not None else [])
    return dict(max_examples=budget, database=database, deadline=None, phases=phases,
                derandomize=False, report_multiple_bugs=True, print_blob=False,
                verbosity=Verbosity.quiet, suppress_health_check=list(HealthCheck))


def _failure_type(types: dict[tuple, type[_ExampleFailed]], key: tuple) -> type[_ExampleFailed]:
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
            return sorted(inner, key=lambda e: e.verdict.failure.search_key)
        raise
    return []


def _one_per_key(failures: list[_ExampleFailed]) -> list[_ExampleFailed]:
    """One failure per location and contract, preferring one whose numbers show the bug."""
    best: dict[tuple[str, str], _ExampleFailed] = {}
    for failed in failures:
        failure = failed.verdict.failure
        if failure.key not in best or failure.search_key[2]:
            best[failure.key] = failed
    return list(best.values())


def _finding(target: FuzzTarget, failed: _ExampleFailed) -> Finding:
    failure: Failure = failed.verdict.failure
    layout, config = split_example(failed.example)
    observed, reference = _numbers(target, failed.example, failed.verdict)
    corrected = None
    if target.fix is not None:
        corrected = _numbers(target, {**failed.example, **target.fix}, None)[0]
    return Finding(title=failure.title, target=target.name, module=target.module, location=failure.location,
                   contract=failure.contract, layout=layout, config=config, observed=observed,
                   reference=reference, corrected=corrected, max_error=failure.max_error,
                   checker=failure.checker, kind=failure.kind, options=target.option_names(config))


def _numbers(target: FuzzTarget, example: Mapping[str, Any], verdict: ExampleVerdict | None) -> tuple[Any, Any]:
    """Observed and reference numbers: measured, or from the check's verdict."""
    if target.measure is not None:
        return target.measure(example)
    verdict = verdict or target.check(example)
    return verdict.observed, verdict.reference


def _store(findings: list[Finding], root: Path | str, target: FuzzTarget, write_repros: bool) -> list[str]:
    """Save the findings (and their repro scripts); the ids of those not seen before."""
    store, new = FindingStore(root), []
    for finding in findings:
        store.place(finding)
        if write_repros and target.repro is not None and finding.kind != TYPE_ONLY:
            with contextlib.suppress(ReproError):  # e.g. a layout the target's template cannot script
                finding.repro = str(target.write_repro(finding, Path(root) / "repro" / f"{finding.id}.py"))
        if store.save(finding):
            new.append(finding.id)
    return new


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
