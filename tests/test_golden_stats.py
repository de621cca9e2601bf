"""Compare statistics on real history pairs, checked against plain-Python recomputation."""

import json
import math
import statistics

import pytest
from golden_data import A2A, TOP2, full_data_root, head, history, history_index, plain_series

from shardcheck.golden.io import load_golden, parse_golden
from shardcheck.golden.stats import (
    MIXED,
    NO_DATA,
    SPIKES,
    UNCHANGED,
    UNIFORM,
    ZERO_IN_BOTH,
    compare_metric,
)


def independent(old_path, new_path, metric):
    """Every statistic recomputed from the JSON with plain Python."""
    old, new = plain_series(old_path, metric), plain_series(new_path, metric)
    steps = [s for s in sorted(set(old) & set(new)) if abs(old[s]) >= 1e-12]
    ratios = [new[s] / old[s] for s in steps]
    return {
        "steps": len(steps),
        "signed": sum((old[s] - new[s]) / old[s] for s in steps) / len(steps),
        "ratio_of_means": (sum(new[s] for s in steps) / len(steps))
        / (sum(old[s] for s in steps) / len(steps)),
        "median": statistics.median(ratios),
        "geo": math.exp(sum(math.log(r) for r in ratios) / len(ratios)),
        "over_5pct": sum(abs(r - 1) > 0.05 for r in ratios) / len(ratios),
    }


def module(old_path, new_path, metric):
    return compare_metric(
        load_golden(old_path).metrics[metric], load_golden(new_path).metrics[metric]
    )


def assert_matches(got, want):
    assert got.steps == want["steps"]
    assert got.megatron_signed_mean == pytest.approx(want["signed"], rel=1e-12)
    assert got.ratio_of_means == pytest.approx(want["ratio_of_means"], rel=1e-12)
    assert got.median_ratio == pytest.approx(want["median"], rel=1e-12)
    assert got.geomean_ratio == pytest.approx(want["geo"], rel=1e-9)
    assert got.share_changed[0.05] == pytest.approx(want["over_5pct"])


def test_transformer_engine_bump_halves_num_zeros_uniformly():
    old, new = history(A2A, "build: Bump TE2.13")
    want = independent(old, new, "num-zeros")
    got = module(old, new, "num-zeros")
    assert_matches(got, want)
    assert 0.45 < got.ratio_of_means < 0.55 and got.pattern == UNIFORM and got.disagreement == ""
    loss = module(old, new, "lm loss")
    assert loss.pattern == UNCHANGED  # the TE bump left the loss curve alone


@pytest.mark.parametrize(
    ("case", "subject"),
    [
        ("bert/bert_mcore_tp1_pp4_vp2", "Update base image to nvcr.io/nvidia/pytorch:26.06"),
        (
            "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_muon",
            "chore: Update Docker image version to 26.04",
        ),
        ("bert/bert_mcore_tp1_pp4_vp2", "build: Bump to NGC PyTorch 26.02"),
    ],
)
def test_base_image_updates_match_independent_numbers(case, subject):
    old, new = history(case, subject)
    for metric in ("lm loss", "num-zeros"):
        assert_matches(module(old, new, metric), independent(old, new, metric))


def test_signed_mean_misleads_on_a_real_pair_and_the_output_says_why():
    # Same test, first run vs resumed run (H100): a few steps where an expert went idle in
    # one run only. Megatron's statistic says num-zeros rose by over 400 %, while the mean
    # count fell and the median step did not move.
    old, new = (
        head(f"{TOP2}/golden_values_dev_dgx_h100_2nd.json"),
        head(f"{TOP2}/golden_values_dev_dgx_h100.json"),
    )
    want = independent(old, new, "num-zeros")
    got = module(old, new, "num-zeros")
    assert_matches(got, want)
    assert want["signed"] < -4 and want["ratio_of_means"] < 1 and abs(want["median"] - 1) < 0.01
    assert "disagrees in sign" in got.disagreement
    old_values, new_values = plain_series(old, "num-zeros"), plain_series(new, "num-zeros")
    terms = {s: (o - new_values[s]) / o for s, o in old_values.items() if s in new_values}
    biggest = min(terms, key=terms.get)
    assert f"step {biggest}:" in got.disagreement


def test_history_has_no_base_image_pair_with_a_huge_signed_mean():
    # Documented finding: the "-769%" case is not among these history files; every
    # consecutive num-zeros pair has |signed mean| < 100 %.
    root = full_data_root()
    index = history_index(root)
    cases = {e["case"] for e in index}
    worst = 0.0
    for case in cases:
        entries = sorted((e for e in index if e["case"] == case), key=lambda e: e["date"])
        for a, b in zip(entries, entries[1:], strict=False):
            paths = [root / "history" / e["file"] for e in (a, b)]
            got = module(*paths, "num-zeros")
            worst = max(worst, abs(got.megatron_signed_mean))
    assert 0.5 < worst < 1.0


def series(values):
    doc = {
        "num-zeros": {
            "start_step": 1,
            "end_step": len(values),
            "step_interval": 1,
            "values": {str(i + 1): v for i, v in enumerate(values)},
        }
    }
    return parse_golden(json.dumps(doc), "hand").metrics["num-zeros"]


BASE = [1000.0 + 37 * (i % 7) for i in range(100)]


def test_classification_rules():
    assert compare_metric(series(BASE), series(BASE)).pattern == UNCHANGED
    assert compare_metric(series(BASE), series([v * 1.3 for v in BASE])).pattern == UNIFORM
    spiky = list(BASE)
    spiky[40] = 1_049_000.0
    spiky[70] = 2_099_000.0
    assert compare_metric(series(BASE), series(spiky)).pattern == SPIKES
    mixed = [v * (1.5 if i % 2 else 0.6) for i, v in enumerate(BASE)]
    assert compare_metric(series(BASE), series(mixed)).pattern == MIXED


def test_disagreement_when_one_small_old_value_jumps():
    old = [1000.0] * 99 + [10.0]
    new = [900.0] * 99 + [1000.0]  # the mean fell 9 %, yet one step rose 100x
    got = compare_metric(series(old), series(new))
    assert got.megatron_signed_mean == pytest.approx((99 * 0.1 + (10 - 1000) / 10) / 100)
    assert got.megatron_signed_mean < 0 < 1 - got.ratio_of_means
    assert "disagrees in sign" in got.disagreement and "step 100" in got.disagreement
    assert compare_metric(series(BASE), series([v * 0.9 for v in BASE])).disagreement == ""


def test_zero_old_steps_are_skipped_like_megatron():
    got = compare_metric(series([0.0, 100.0, 100.0]), series([5.0, 110.0, 90.0]))
    assert got.steps == 2 and got.skipped_zero_old == 1
    assert got.megatron_signed_mean == pytest.approx(0.0)


def test_a_count_zero_at_every_step_on_both_sides_is_zero_in_both_not_changed():
    """num-zeros of a float32 run where no expert went idle: 0 at every step in both runs.
    Megatron's statistic skips every step (old is 0), but nothing moved."""
    got = compare_metric(series([0.0, 0.0, 0.0]), series([0.0, 0.0, 0.0]))
    assert (got.steps, got.skipped_zero_old, got.pattern, got.changed) == (0, 3, ZERO_IN_BOTH, False)
    rising = compare_metric(series([0.0, 0.0, 0.0]), series([0.0, 32768.0, 0.0]))  # an expert went idle
    assert (rising.pattern, rising.changed) == (NO_DATA, True)
