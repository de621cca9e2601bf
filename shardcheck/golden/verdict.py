"""The pass/fail verdict Megatron-LM's functional-test CI gives a run against its golden values.

Reimplemented from the behaviour of Megatron-LM's
``tests/functional_tests/python_test_utils`` (see docs/golden.md for each rule's source).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shardcheck.golden.io import GoldenFile, MetricSeries

DETERMINISTIC = "deterministic"
APPROXIMATE = "approximate"
ITERATION_TIME = "iteration-time"

# metric -> (has an exact check, relative tolerance of the approximate check)
CI_THRESHOLDS: dict[str, tuple[bool, float]] = {
    "iteration-time": (False, 0.05),
    "mem-allocated-bytes": (False, 0.05),
    "mem-max-allocated-bytes": (False, 0.05),
    "lm loss": (True, 0.05),
    "mtp_1 loss": (True, 0.05),
    "mtp_2 loss": (True, 0.05),
    "total loss": (True, 0.05),
    "num-zeros": (True, 0.20),
}


@dataclass(frozen=True)
class CheckResult:
    """One CI check (exact or approximate) of one metric."""

    metric: str
    kind: str
    passed: bool
    rtol: float = 0.0
    steps_evaluated: int = 0
    failing_steps: tuple[int, ...] = ()
    allowed_failures: int = 0
    detail: str = ""


@dataclass(frozen=True)
class Verdict:
    """All checks in the order the CI runs them; ``passed`` only if every one passed."""

    results: tuple[CheckResult, ...]
    warnings: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)


def allowed_failing_steps(total_steps: int) -> int:
    """Failing steps an approximate check tolerates: min(max(N // 100, 1), 50)."""
    return min(max(total_steps // 100, 1), 50)


def ci_verdict(
    golden: GoldenFile,
    actual: GoldenFile,
    metrics: Sequence[str],
    allow_nondeterministic: bool = False,
) -> Verdict:
    """Run the CI's checks of ``metrics``; exact checks are skipped when nondeterminism is allowed."""
    results: list[CheckResult] = []
    for metric in metrics:
        problem = _setup_problem(metric, golden, actual)
        if problem:
            results.append(CheckResult(metric, "setup", False, detail=problem))
            continue
        exact, rtol = CI_THRESHOLDS[metric]
        if exact and not allow_nondeterministic:
            results.append(
                _check(golden.metrics[metric], actual.metrics[metric], 0.0, DETERMINISTIC)
            )
        results.append(_check(golden.metrics[metric], actual.metrics[metric], rtol, APPROXIMATE))
    return Verdict(tuple(results), tuple(blind_spots(golden, actual, metrics)))


def _setup_problem(metric: str, golden: GoldenFile, actual: GoldenFile) -> str:
    if metric not in CI_THRESHOLDS:
        return f"the CI defines no check for {metric!r} (its lookup would raise KeyError)"
    if metric not in golden.metrics:
        return f"{metric!r} is required by the config but missing from the golden values"
    if metric not in actual.metrics:
        return f"{metric!r} was not logged by the run (missing from the actual values)"
    if len(golden.metrics[metric].steps) == 0:
        return f"{metric!r} has no values in the golden file"
    return ""


def ci_values(series: MetricSeries, steps: np.ndarray) -> np.ndarray:
    """Values at ``steps`` as the CI compares them: strings and missing steps become +inf."""
    lookup = dict(
        zip(
            series.steps.tolist(),
            np.where(series.text, np.inf, series.values).tolist(),
            strict=True,
        )
    )
    return np.array([lookup.get(s, np.inf) for s in steps.tolist()], dtype=np.float64)


def _check(golden: MetricSeries, actual: MetricSeries, rtol: float, kind: str) -> CheckResult:
    if golden.name == ITERATION_TIME:
        return _check_iteration_time(golden, actual, rtol)
    golden_values = ci_values(golden, golden.steps)
    actual_values = ci_values(actual, golden.steps)
    close = np.isclose(actual_values, golden_values, rtol=rtol, atol=0)
    total = len(golden.steps)
    failing = tuple(int(s) for s in golden.steps[~close])
    if kind == DETERMINISTIC or total == 1:
        return CheckResult(golden.name, kind, bool(close.all()), rtol, total, failing, 0)
    allowed = allowed_failing_steps(total)
    passed = bool(np.mean(close) >= 1 - allowed / total)
    return CheckResult(golden.name, kind, passed, rtol, total, failing, allowed)


def steady_window(golden: MetricSeries) -> list[int]:
    """The iteration-time steps the CI takes the median over (steps 5-20 or 30-45)."""
    finite_steps = golden.steps[~golden.text & np.isfinite(golden.values)].tolist()
    if not finite_steps:
        return []
    window = range(5, 21) if finite_steps[-1] <= 25 else range(30, 46)
    inside = [s for s in finite_steps if s in window]
    return inside or [s for s in finite_steps if s >= window.start][:4]


def _check_iteration_time(golden: MetricSeries, actual: MetricSeries, rtol: float) -> CheckResult:
    steps = np.array(steady_window(golden), dtype=np.int64)
    if len(steps) == 0:
        return CheckResult(
            golden.name,
            APPROXIMATE,
            False,
            rtol,
            detail="no finite golden values in or after the warm-up window",
        )
    golden_median = float(np.median(ci_values(golden, steps)))
    actual_median = float(np.median(ci_values(actual, steps)))
    passed = bool(np.isclose(actual_median, golden_median, rtol=rtol, atol=0))
    detail = f"median of steps {steps[0]}-{steps[-1]}: golden {golden_median:.5g}, actual {actual_median:.5g}"
    return CheckResult(golden.name, APPROXIMATE, passed, rtol, 1, (), 0, detail)


def blind_spots(golden: GoldenFile, actual: GoldenFile, metrics: Sequence[str]) -> list[str]:
    """Places where the CI's verdict says less than it seems to."""
    warnings: list[str] = []
    if not metrics:
        warnings.append("no metrics to check: the CI passes without comparing anything")
    for metric in metrics:
        if metric not in golden.metrics or metric not in actual.metrics:
            continue
        g, a = golden.metrics[metric], actual.metrics[metric]
        warnings += _nan_meets_missing(g, a)
        warnings += _unchecked_actual_steps(g, a)
        if metric != ITERATION_TIME:
            warnings += _tolerated_outliers(g, a, CI_THRESHOLDS.get(metric, (True, 0.05))[1])
    return warnings


def _nan_meets_missing(golden: MetricSeries, actual: MetricSeries) -> list[str]:
    actual_numbers = set(actual.steps[~actual.text].tolist())
    blind = [int(s) for s in golden.steps[golden.text] if int(s) not in actual_numbers]
    if not blind:
        return []
    return [
        f'{golden.name}: {len(blind)} step(s) ({_steps_text(blind)}) are "nan" in the golden file '
        'and missing or "nan" in the run; the CI compares them as inf == inf and passes them '
        "unchecked"
    ]


def _unchecked_actual_steps(golden: MetricSeries, actual: MetricSeries) -> list[str]:
    extra = sorted(set(actual.steps.tolist()) - set(golden.steps.tolist()))
    if not extra:
        return []
    return [
        f"{golden.name}: {len(extra)} logged step(s) ({_steps_text(extra)}) have no golden value; "
        "the CI never looks at them"
    ]


def _tolerated_outliers(golden: MetricSeries, actual: MetricSeries, rtol: float) -> list[str]:
    steps = golden.steps
    g, a = ci_values(golden, steps), ci_values(actual, steps)
    with np.errstate(divide="ignore", invalid="ignore"):
        far = np.isfinite(g) & np.isfinite(a) & (np.abs(a - g) > 10 * rtol * np.abs(g))
    allowed = allowed_failing_steps(len(steps))
    failing = int((~np.isclose(a, g, rtol=rtol, atol=0)).sum())
    if not far.any() or failing > allowed or len(steps) <= 1:
        return []
    worst = [int(s) for s in steps[far]]
    return [
        f"{golden.name}: step(s) {_steps_text(worst)} are off by more than 10x the tolerance, yet "
        f"the approximate check passes because it allows {allowed} failing step(s)"
    ]


def _steps_text(steps: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f", ... ({len(steps) - limit} more)" if len(steps) > limit else "")
