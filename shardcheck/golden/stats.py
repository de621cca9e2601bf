"""Statistics of one metric between an old and a new run that don't mislead, and why one does.

Megatron's golden-value compare script prints ``mean((old - new) / old)`` over the shared
finite steps, skipping ``|old| < 1e-12``. That is ``1 - mean(new / old)``: a mean of per-step
ratios. It is bounded by +100 % when values fall but unbounded when a small old value rises,
so a few steps can dominate it. Beside it we report ratios that are robust to that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardcheck.golden.io import MetricSeries

ZERO_EPS = 1e-12
CHANGE_LEVELS = (0.01, 0.05, 0.20)
UNCHANGED_TOL = 0.01
SPIKE_SHARE = 0.80
SPIKE_STEP_FRACTION = 0.05
UNIFORM_MOVED_SHARE = 0.80
DISAGREE_FACTOR = 3.0

UNCHANGED, UNIFORM, SPIKES, MIXED, NO_DATA, ZERO_IN_BOTH = (
    "unchanged",
    "uniform shift",
    "spike changes",
    "mixed",
    "no shared steps",
    "zero in both",
)


@dataclass(frozen=True)
class StepChange:
    """One step's old and new value."""

    step: int
    old: float
    new: float

    @property
    def ratio(self) -> float:
        return self.new / self.old if self.old else math.inf


@dataclass(frozen=True)
class MetricComparison:
    """How one metric changed between two runs."""

    metric: str
    steps: int
    skipped_zero_old: int
    megatron_signed_mean: float
    old_mean: float
    new_mean: float
    ratio_of_means: float
    median_ratio: float
    geomean_ratio: float
    share_changed: dict[float, float]
    changed_steps: dict[float, tuple[StepChange, ...]]
    largest: tuple[StepChange, ...]
    pattern: str
    disagreement: str

    @property
    def changed(self) -> bool:
        """Whether the metric moved: neither unchanged nor zero at every step on both sides."""
        return self.pattern not in (UNCHANGED, ZERO_IN_BOTH)


@dataclass(frozen=True)
class PairedSteps:
    """Steps where both runs have finite values, with ``|old| >= 1e-12``."""

    steps: np.ndarray
    old: np.ndarray
    new: np.ndarray
    skipped_zero_old: int
    skipped_zero_both: int = 0  # of the skipped steps, those where new is ~0 too


def paired_steps(old: MetricSeries, new: MetricSeries, skip_zero_old: bool = True) -> PairedSteps:
    """Align two series on their shared finite steps, dropping steps where old is ~0 (as
    Megatron's relative statistic does) unless ``skip_zero_old`` is False."""
    if np.array_equal(old.steps, new.steps):
        usable = np.isfinite(old.values) & np.isfinite(new.values)
        shared, o, n = old.steps[usable], old.values[usable], new.values[usable]
    else:
        old_steps, old_values = old.finite()
        new_steps, new_values = new.finite()
        shared, old_at, new_at = np.intersect1d(old_steps, new_steps, return_indices=True)
        o, n = old_values[old_at], new_values[new_at]
    keep = (np.abs(o) >= ZERO_EPS) | (not skip_zero_old)
    both = int(np.count_nonzero(~keep & (np.abs(n) < ZERO_EPS)))
    return PairedSteps(shared[keep], o[keep], n[keep], int((~keep).sum()), both)


def compare_metric(old: MetricSeries, new: MetricSeries, top: int = 5) -> MetricComparison:
    """All statistics of one metric; see the module docstring."""
    pair = paired_steps(old, new)
    if len(pair.steps) == 0:
        no_numbers = (math.nan,) * 6  # signed mean, the two means and the three ratios
        # every shared step is ~0 on both sides (a count such as num-zeros that stayed 0):
        # no ratio exists, and nothing changed
        both = pair.skipped_zero_old and pair.skipped_zero_both == pair.skipped_zero_old
        return MetricComparison(
            old.name, 0, pair.skipped_zero_old, *no_numbers, {}, {}, (),
            ZERO_IN_BOTH if both else NO_DATA, ""
        )
    n = len(pair.steps)
    ratio = pair.new / pair.old
    deviation = np.abs(ratio - 1)
    signed = float(((pair.old - pair.new) / pair.old).sum()) / n
    old_mean, new_mean = float(pair.old.sum()) / n, float(pair.new.sum()) / n
    ratio_of_means = new_mean / old_mean if old_mean else math.nan
    median_ratio = float(np.median(ratio))
    changed = {level: steps_beyond(pair, deviation > level) for level in CHANGE_LEVELS}
    return MetricComparison(
        metric=old.name,
        steps=n,
        skipped_zero_old=pair.skipped_zero_old,
        megatron_signed_mean=signed,
        old_mean=old_mean,
        new_mean=new_mean,
        ratio_of_means=ratio_of_means,
        median_ratio=median_ratio,
        geomean_ratio=geometric_mean_ratio(ratio),
        share_changed={level: len(steps) / n for level, steps in changed.items()},
        changed_steps=changed,
        largest=largest_changes(pair, top),
        pattern=classify(pair),
        disagreement=explain_disagreement(pair, signed, ratio_of_means, median_ratio),
    )


def geometric_mean_ratio(ratio: np.ndarray) -> float:
    """exp(mean(log r)) over the steps with a positive ratio (NaN if there are none)."""
    positive = ratio[ratio > 0]
    return float(np.exp(np.mean(np.log(positive)))) if len(positive) else math.nan


def steps_beyond(pair: PairedSteps, mask: np.ndarray) -> tuple[StepChange, ...]:
    """Every step selected by ``mask``, in step order."""
    return tuple(
        StepChange(int(s), float(o), float(n))
        for s, o, n in zip(pair.steps[mask], pair.old[mask], pair.new[mask], strict=True)
    )


def largest_changes(pair: PairedSteps, top: int) -> tuple[StepChange, ...]:
    """The ``top`` steps with the largest change in log scale (|log(new/old)|)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        size = np.abs(np.log(np.abs(pair.new / pair.old)))
    size = np.where(np.isnan(size), np.inf, size)
    order = np.argsort(-size, kind="stable")[:top]
    return tuple(
        StepChange(int(pair.steps[i]), float(pair.old[i]), float(pair.new[i]))
        for i in order
        if size[i] > 0
    )


def classify(pair: PairedSteps) -> str:
    """unchanged, uniform shift, spike changes or mixed (rules in docs/golden.md)."""
    ratio = pair.new / pair.old
    moved = np.abs(ratio - 1) > UNCHANGED_TOL
    if not moved.any():
        return UNCHANGED
    if _is_uniform(ratio, moved):
        return UNIFORM
    if _is_spiky(np.abs(pair.new - pair.old)):
        return SPIKES
    return MIXED


def _is_uniform(ratio: np.ndarray, moved: np.ndarray) -> bool:
    if np.mean(moved) < UNIFORM_MOVED_SHARE or np.any(ratio <= 0):
        return False
    logs = np.log(ratio)
    centre = np.median(logs)
    same_side = np.mean(np.sign(logs[moved]) == np.sign(centre))
    spread = np.subtract(*np.percentile(logs, [75, 25]))
    return bool(same_side >= 0.9 and spread <= 0.5 * abs(centre))


def _is_spiky(abs_change: np.ndarray) -> bool:
    k = max(1, math.ceil(SPIKE_STEP_FRACTION * len(abs_change)))
    if k >= len(abs_change):
        return False
    top = np.sort(abs_change)[::-1][:k].sum()
    return bool(top >= SPIKE_SHARE * abs_change.sum())


def format_value(x: float) -> str:
    """A metric value for people: thousands separators for large counts, 6 digits otherwise."""
    if math.isfinite(x) and abs(x) >= 1e3 and float(x).is_integer():
        return f"{x:,.0f}"
    return f"{x:.6g}"


def _direction(shift: float) -> int:
    """+1 for up, -1 for down, 0 for within the unchanged band."""
    return 0 if abs(shift) <= UNCHANGED_TOL else (1 if shift > 0 else -1)


def explain_disagreement(
    pair: PairedSteps, signed: float, ratio_of_means: float, median_ratio: float
) -> str:
    """Say why the signed mean of per-step changes disagrees with the robust ratios, if it does."""
    signed_dir = _direction(-signed)
    robust = (ratio_of_means - 1, median_ratio - 1)
    robust_dirs = {_direction(x) for x in robust if math.isfinite(x)}
    size = max((abs(x) for x in robust if math.isfinite(x)), default=0.0)
    opposite = signed_dir != 0 and -signed_dir in robust_dirs
    oversized = abs(signed) > max(0.05, DISAGREE_FACTOR * size)
    if not (opposite or oversized):
        return ""
    return _blame_steps(pair, signed, ratio_of_means, median_ratio, opposite)


def _blame_steps(
    pair: PairedSteps, signed: float, ratio_of_means: float, median_ratio: float, opposite: bool
) -> str:
    terms = (pair.old - pair.new) / pair.old
    order = np.argsort(-np.abs(terms), kind="stable")
    k = max(1, min(3, len(order)))
    share = float(np.abs(terms[order[:k]]).sum() / np.abs(terms).sum())
    worst = ", ".join(
        f"step {int(pair.steps[i])}: {format_value(pair.old[i])} -> "
        f"{format_value(pair.new[i])} ({terms[i]:+.0%})"
        for i in order[:k]
    )
    verb = "disagrees in sign with" if opposite else "is far larger than"
    return (
        f"the signed mean of (old-new)/old ({signed:+.1%}) {verb} the ratio of means "
        f"({ratio_of_means:.3f}) and the median ratio ({median_ratio:.3f}): each step's term "
        f"is at most +100% when the value falls but has no lower bound when a small old value "
        f"rises, so a few such steps dominate the mean; the {k} largest term(s) make up {share:.0%} of its absolute sum "
        f"({worst})"
    )
