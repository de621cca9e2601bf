"""Repeats: permutation test, noise bands and Megatron's recommended tolerance."""

import itertools
import json
import math
import random
import statistics

import numpy as np
import pytest
from golden_data import EP8, head, plain_series

from shardcheck.golden.io import load_golden, parse_golden
from shardcheck.golden.noise import noise_verdict, permutation_p_value, recommended_tolerance


def p_by_hand(old_rows, new_rows):
    """Two-sided permutation p of the median log ratio, enumerated with itertools."""

    def stat(a, b):
        steps = range(len(a[0]))
        return statistics.median(
            math.log(statistics.mean(r[s] for r in b) / statistics.mean(r[s] for r in a))
            for s in steps
        )

    pooled = old_rows + new_rows
    observed = abs(stat(old_rows, new_rows))
    hits = total = 0
    for chosen in itertools.combinations(range(len(pooled)), len(old_rows)):
        a = [pooled[i] for i in chosen]
        b = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        hits += abs(stat(a, b)) >= observed - 1e-12
        total += 1
    return hits / total


def test_permutation_p_matches_enumeration_by_hand():
    rng = random.Random(3)
    old = [[100 * (1 + rng.gauss(0, 0.02)) for _ in range(30)] for _ in range(4)]
    new = [[103 * (1 + rng.gauss(0, 0.02)) for _ in range(30)] for _ in range(3)]
    p, smallest = permutation_p_value(np.array(old), np.array(new))
    assert p == pytest.approx(p_by_hand(old, new))
    assert smallest == pytest.approx(1 / math.comb(7, 4))


def runs_from(base, factors):
    """Runs built from one real loss curve, each scaled per step by its own noise."""
    runs = []
    for factor_row in factors:
        values = {str(s): v * f for (s, v), f in zip(sorted(base.items()), factor_row, strict=True)}
        doc = {
            "lm loss": {
                "start_step": 1,
                "end_step": len(values),
                "step_interval": 1,
                "values": values,
            }
        }
        runs.append(parse_golden(json.dumps(doc), "run"))
    return runs


def test_shift_beyond_noise_is_detected_and_pure_noise_is_not():
    base = plain_series(head(f"{EP8}/golden_values_dev_dgx_h100.json"), "lm loss")
    rng = random.Random(7)
    noise = [[1 + rng.gauss(0, 0.003) for _ in base] for _ in range(10)]
    old = runs_from(base, noise[:5])
    shifted = runs_from(base, [[f * 1.01 for f in row] for row in noise[5:]])
    same = runs_from(base, noise[5:])
    assert noise_verdict(old, shifted, "lm loss").exceeds_noise is True
    calm = noise_verdict(old, same, "lm loss")
    assert calm.exceeds_noise is False and calm.p_value > 0.05


def test_two_runs_are_too_few_to_tell():
    first = load_golden(head(f"{EP8}/golden_values_dev_dgx_h100.json"))
    second = load_golden(head(f"{EP8}/golden_values_dev_dgx_h100_2nd.json"))
    verdict = noise_verdict([first], [second], "num-zeros")
    assert verdict.exceeds_noise is None and verdict.smallest_p == 1.0
    assert verdict.steps == 50  # the second run has numbers only after the resume


def test_megatron_tolerance_is_max_relative_deviation_times_1_5():
    paths = [
        head(f"{EP8}/golden_values_dev_dgx_h100.json"),
        head(f"{EP8}/golden_values_dev_dgx_h100_2nd.json"),
    ]
    samples = {}
    for path in paths:
        for step, value in plain_series(path, "num-zeros").items():
            samples.setdefault(step, []).append(value)
    worst = 0.0
    for values in samples.values():
        mean = sum(values) / len(values)
        worst = max(worst, *(abs(v - mean) / abs(mean) for v in values))
    deviation, tolerance = recommended_tolerance([load_golden(p) for p in paths], "num-zeros")
    assert deviation == pytest.approx(worst)
    assert tolerance == round(max(worst * 1.5, 0.001), 4)
    assert tolerance > 0.9  # the idle experts make num-zeros wildly run-dependent


def test_iteration_time_tolerance_uses_per_run_medians():
    paths = [
        head(f"{EP8}/golden_values_dev_dgx_h100.json"),
        head(f"{EP8}/golden_values_dev_dgx_h100_2nd.json"),
    ]
    medians = [statistics.median(plain_series(p, "iteration-time").values()) for p in paths]
    centre = sum(medians) / 2
    worst = max(abs(m - centre) / centre for m in medians)
    deviation, _ = recommended_tolerance([load_golden(p) for p in paths], "iteration-time")
    assert deviation == pytest.approx(worst)
