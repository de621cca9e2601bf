"""Run-to-run noise: per-step bands, a permutation test on per-step ratios, and Megatron's tolerance.

The test is an exact permutation test over run labels. The statistic is the median over
steps of ``log(mean_new(step) / mean_old(step))``; under the null hypothesis (old and new
runs are exchangeable) every split of the pooled runs into groups of the original sizes
is equally likely. The p-value is the share of splits whose |statistic| is at least the
observed one. All splits are enumerated up to 20,000, beyond that a seeded random sample.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05
MAX_SPLITS = 20_000
CONFIDENCE_MULTIPLIER = 1.5
MEDIAN_BASED = ("iteration-time",)
MAX_BASED = ("mem-allocated-bytes", "mem-max-allocated-bytes")


@dataclass(frozen=True)
class Band:
    """Per-step mean, minimum and maximum over the runs of one side."""

    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray

    def median_relative_width(self) -> float:
        """Median over steps of (max - min) / mean: the typical run-to-run spread."""
        return (
            float(np.median((self.high - self.low) / np.abs(self.mean))) if len(self.steps) else 0.0
        )


@dataclass(frozen=True)
class NoiseVerdict:
    """Whether the shift between two groups of runs exceeds their run-to-run noise."""

    metric: str
    old_runs: int
    new_runs: int
    steps: int
    median_log_ratio: float
    p_value: float
    smallest_p: float
    outside_old_band: float
    old_band: Band
    new_band: Band
    tolerance_old: float
    tolerance_new: float

    @property
    def exceeds_noise(self) -> bool | None:
        """True/False from the permutation test; None when too few runs to reach ALPHA."""
        if self.smallest_p > ALPHA:
            return None
        return self.p_value <= ALPHA


def run_matrix(runs: Sequence, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps where every run has a finite positive value, and the runs x steps matrix."""
    common = None
    for run in runs:
        steps, values = run.metrics[metric].finite()
        good = set(steps[values > 0].tolist())
        common = good if common is None else common & good
    steps = np.array(sorted(common or ()), dtype=np.int64)
    rows = [_values_at(run.metrics[metric], steps) for run in runs]
    return steps, np.array(rows, dtype=np.float64).reshape(len(runs), len(steps))


def _values_at(series, steps: np.ndarray) -> np.ndarray:
    index = np.searchsorted(series.steps, steps)
    return series.values[index]


def band(steps: np.ndarray, matrix: np.ndarray) -> Band:
    """Per-step mean, min and max over the rows of ``matrix``."""
    return Band(steps, matrix.mean(axis=0), matrix.min(axis=0), matrix.max(axis=0))


def median_log_ratio(old: np.ndarray, new: np.ndarray) -> float:
    """Median over steps of log(mean of new runs / mean of old runs)."""
    return float(np.median(np.log(new.mean(axis=0) / old.mean(axis=0))))


def permutation_p_value(old: np.ndarray, new: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """Two-sided p-value of the median log ratio over run-label splits, and the smallest possible."""
    pooled = np.vstack([old, new])
    n_total, n_old = len(pooled), len(old)
    observed = abs(median_log_ratio(old, new))
    splits = _splits(n_total, n_old, seed)
    stats = np.array([abs(_split_stat(pooled, idx)) for idx in splits])
    p = float(np.mean(stats >= observed - 1e-12))
    ties_at_best = 2 if n_old * 2 == n_total else 1
    return p, min(1.0, ties_at_best / len(splits))


def _split_stat(pooled: np.ndarray, old_idx: tuple[int, ...]) -> float:
    mask = np.zeros(len(pooled), dtype=bool)
    mask[list(old_idx)] = True
    return median_log_ratio(pooled[mask], pooled[~mask])


def _splits(n_total: int, n_old: int, seed: int) -> list[tuple[int, ...]]:
    if math.comb(n_total, n_old) <= MAX_SPLITS:
        return list(itertools.combinations(range(n_total), n_old))
    rng = np.random.default_rng(seed)
    first = tuple(range(n_old))
    drawn = [
        tuple(sorted(rng.choice(n_total, n_old, replace=False))) for _ in range(MAX_SPLITS - 1)
    ]
    return [first, *drawn]


def recommended_tolerance(runs: Sequence, metric: str) -> tuple[float, float]:
    """Megatron's recommendation: max observed relative deviation x 1.5 (at least 0.001).

    Per step for most metrics; for iteration-time the deviation of per-run medians, for
    memory metrics of per-run maxima (skipping the first value), as Megatron's
    compute_golden_statistics.py does. Returns (max relative deviation, tolerance).
    """
    per_run = [run.metrics[metric].finite()[1] for run in runs]
    if metric in MEDIAN_BASED:
        deviation = _max_rel_deviation([[float(np.median(v))] for v in per_run if len(v)])
    elif metric in MAX_BASED:
        deviation = _max_rel_deviation(
            [[float(np.max(v[1:] if len(v) > 1 else v))] for v in per_run if len(v)]
        )
    else:
        deviation = _per_step_deviation(runs, metric)
    return deviation, round(max(deviation * CONFIDENCE_MULTIPLIER, 0.001), 4)


def _max_rel_deviation(columns: list[list[float]]) -> float:
    values = np.array([c[0] for c in columns], dtype=np.float64)
    if len(values) == 0 or abs(values.mean()) <= 1e-9:
        return 0.0
    return float(np.max(np.abs(values - values.mean()) / abs(values.mean())))


def _per_step_deviation(runs: Sequence, metric: str) -> float:
    samples: dict[int, list[float]] = {}
    for run in runs:
        steps, values = run.metrics[metric].finite()
        for step, value in zip(steps.tolist(), values.tolist(), strict=True):
            samples.setdefault(step, []).append(value)
    worst = 0.0
    for values in samples.values():
        centre = sum(values) / len(values)
        if abs(centre) > 1e-9:
            worst = max(worst, max(abs(v - centre) / abs(centre) for v in values))
    return worst


def noise_verdict(old_runs: Sequence, new_runs: Sequence, metric: str) -> NoiseVerdict | None:
    """Bands, permutation test and tolerances for one metric; None if no step has data in all runs."""
    if any(metric not in run.metrics for run in (*old_runs, *new_runs)):
        return None
    steps, matrix = run_matrix([*old_runs, *new_runs], metric)
    if len(steps) == 0:
        return None
    old, new = matrix[: len(old_runs)], matrix[len(old_runs) :]
    p, smallest = permutation_p_value(old, new)
    old_band = band(steps, old)
    new_mean = new.mean(axis=0)
    outside = float(np.mean((new_mean < old_band.low) | (new_mean > old_band.high)))
    return NoiseVerdict(
        metric=metric,
        old_runs=len(old_runs),
        new_runs=len(new_runs),
        steps=len(steps),
        median_log_ratio=median_log_ratio(old, new),
        p_value=p,
        smallest_p=smallest,
        outside_old_band=outside,
        old_band=old_band,
        new_band=band(steps, new),
        tolerance_old=recommended_tolerance(old_runs, metric)[1],
        tolerance_new=recommended_tolerance(new_runs, metric)[1],
    )
