"""Megatron CI verdict, one hand-built case per rule (expected results worked out by hand)."""

import json

import pytest

from shardcheck.golden.config import parse_model_config
from shardcheck.golden.io import parse_golden
from shardcheck.golden.verdict import allowed_failing_steps, ci_verdict, steady_window


def run(**metrics):
    """A golden-values document: metric name (underscores for spaces/dashes) -> {step: value}."""
    doc = {}
    for key, values in metrics.items():
        name = {"lm_loss": "lm loss", "num_zeros": "num-zeros", "iteration_time": "iteration-time"}[
            key
        ]
        steps = sorted(values)
        doc[name] = {
            "start_step": steps[0],
            "end_step": steps[-1],
            "step_interval": 1,
            "values": {str(s): values[s] for s in steps},
        }
    return parse_golden(json.dumps(doc), "hand-built")


def outcome(verdict):
    return [(r.metric, r.kind, r.passed) for r in verdict.results]


LOSS = {s: 10.0 - s / 100 for s in range(1, 101)}


def test_identical_runs_pass_exact_then_approximate_checks_in_that_order():
    verdict = ci_verdict(run(lm_loss=LOSS), run(lm_loss=LOSS), ["lm loss"])
    assert outcome(verdict) == [
        ("lm loss", "deterministic", True),
        ("lm loss", "approximate", True),
    ]


def test_one_ulp_fails_the_exact_check_but_not_the_approximate_one():
    actual = LOSS | {7: LOSS[7] + 1e-12}
    verdict = ci_verdict(run(lm_loss=LOSS), run(lm_loss=actual), ["lm loss"])
    assert outcome(verdict) == [
        ("lm loss", "deterministic", False),
        ("lm loss", "approximate", True),
    ]
    assert verdict.results[0].failing_steps == (7,)
    assert not verdict.passed


def test_allow_nondeterministic_skips_the_exact_check():
    actual = LOSS | {7: LOSS[7] + 1e-12}
    verdict = ci_verdict(
        run(lm_loss=LOSS), run(lm_loss=actual), ["lm loss"], allow_nondeterministic=True
    )
    assert outcome(verdict) == [("lm loss", "approximate", True)]
    assert verdict.passed


@pytest.mark.parametrize(
    ("golden", "actual", "metric", "passes"),
    [
        (100.0, 105.0, "lm_loss", True),  # exactly 5 % of golden
        (100.0, 105.01, "lm_loss", False),
        (100.0, 80.0, "num_zeros", True),  # 20 % of golden (100) ...
        (80.0, 100.0, "num_zeros", False),  # ... but 25 % of golden (80): relative to golden
        (100.0, 119.0, "num_zeros", True),
        (100.0, 119.0, "lm_loss", False),  # lm loss has the tighter 5 %
        (0.0, 1e-30, "num_zeros", False),  # atol is 0: a zero golden needs an exact zero
    ],
)
def test_approximate_tolerance_is_relative_to_golden(golden, actual, metric, passes):
    name = metric.replace("_", " " if metric == "lm_loss" else "-")
    verdict = ci_verdict(run(**{metric: {1: golden}}), run(**{metric: {1: actual}}), [name], True)
    assert verdict.results[0].passed is passes


@pytest.mark.parametrize(
    ("n", "allowed"), [(1, 1), (99, 1), (100, 1), (250, 2), (4999, 49), (6000, 50)]
)
def test_allowed_failing_steps_formula(n, allowed):
    assert allowed_failing_steps(n) == allowed


@pytest.mark.parametrize(
    ("n", "bad", "passes"), [(100, 1, True), (100, 2, False), (250, 2, True), (250, 3, False)]
)
def test_approximate_check_allows_that_many_failing_steps(n, bad, passes):
    golden = {s: 5.0 for s in range(1, n + 1)}
    actual = golden | {s: 50.0 for s in range(1, bad + 1)}
    verdict = ci_verdict(run(lm_loss=golden), run(lm_loss=actual), ["lm loss"], True)
    result = verdict.results[0]
    assert result.passed is passes
    assert result.failing_steps == tuple(range(1, bad + 1))


def test_one_failing_step_is_allowed_even_among_two_but_not_alone():
    verdict = ci_verdict(
        run(lm_loss={1: 1.0, 2: 1.0}), run(lm_loss={1: 1.0, 2: 9.0}), ["lm loss"], True
    )
    assert verdict.passed  # mean(close) = 0.5 >= 1 - 1/2
    verdict = ci_verdict(run(lm_loss={1: 1.0}), run(lm_loss={1: 9.0}), ["lm loss"], True)
    assert not verdict.passed


def test_missing_actual_step_fails_against_a_finite_golden():
    actual = {s: v for s, v in LOSS.items() if s != 50}
    verdict = ci_verdict(run(lm_loss=LOSS), run(lm_loss=actual), ["lm loss"])
    assert outcome(verdict) == [
        ("lm loss", "deterministic", False),
        ("lm loss", "approximate", True),
    ]
    assert verdict.results[0].failing_steps == (50,)


def test_blind_spot_golden_nan_against_missing_actual_passes_and_is_warned():
    golden = LOSS | {s: "nan" for s in range(1, 51)}
    actual = {s: v for s, v in LOSS.items() if s > 50}
    verdict = ci_verdict(run(lm_loss=golden), run(lm_loss=actual), ["lm loss"])
    assert verdict.passed  # inf == inf: the CI passes 50 steps nobody checked
    assert len(verdict.warnings) == 1
    assert "inf == inf" in verdict.warnings[0] and "50 step(s)" in verdict.warnings[0]


def test_no_blind_spot_warning_when_every_golden_step_is_a_number():
    verdict = ci_verdict(run(lm_loss=LOSS), run(lm_loss=LOSS), ["lm loss"])
    assert verdict.warnings == ()


def test_golden_nan_against_a_logged_number_fails():
    golden = LOSS | {3: "nan"}
    verdict = ci_verdict(run(lm_loss=golden), run(lm_loss=LOSS), ["lm loss"])
    assert verdict.results[0].failing_steps == (3,)
    assert not verdict.results[0].passed


def test_float_nan_never_equals_anything():
    golden = parse_golden(
        '{"lm loss": {"start_step": 1, "end_step": 1, "step_interval": 1, "values": {"1": NaN}}}',
        "g",
    )
    verdict = ci_verdict(golden, golden, ["lm loss"])
    assert outcome(verdict) == [
        ("lm loss", "deterministic", False),
        ("lm loss", "approximate", False),
    ]


def test_unchecked_extra_actual_steps_are_warned():
    actual = LOSS | {s: 99.0 for s in range(101, 121)}
    verdict = ci_verdict(run(lm_loss=LOSS), run(lm_loss=actual), ["lm loss"])
    assert verdict.passed
    assert any("20 logged step(s)" in w for w in verdict.warnings)


def test_tolerated_wild_outlier_is_warned():
    actual = LOSS | {9: 1e6}
    verdict = ci_verdict(run(lm_loss=LOSS), run(lm_loss=actual), ["lm loss"], True)
    assert verdict.passed
    assert any("step(s) 9 are off by more than 10x" in w for w in verdict.warnings)


def _times(max_step, fast, slow_steps=(), slow=9.0):
    return {s: (slow if s in slow_steps else fast) for s in range(2, max_step + 1)}


def test_iteration_time_uses_the_median_of_steps_30_to_45_for_long_runs():
    golden = _times(100, 1.0)
    actual = _times(100, 1.04, slow_steps=range(2, 30))  # warm-up outliers are outside the window
    verdict = ci_verdict(run(iteration_time=golden), run(iteration_time=actual), ["iteration-time"])
    assert outcome(verdict) == [("iteration-time", "approximate", True)]
    assert "steps 30-45" in verdict.results[0].detail
    slower = _times(100, 1.06)
    verdict = ci_verdict(run(iteration_time=golden), run(iteration_time=slower), ["iteration-time"])
    assert not verdict.passed


def test_iteration_time_median_ignores_a_minority_of_slow_steps_in_the_window():
    actual = _times(100, 1.0, slow_steps=range(30, 37))  # 7 of 16 window steps slow
    verdict = ci_verdict(
        run(iteration_time=_times(100, 1.0)), run(iteration_time=actual), ["iteration-time"]
    )
    assert verdict.passed


def test_iteration_time_window_for_short_runs_and_fallback():
    short = run(iteration_time=_times(25, 1.0)).metrics["iteration-time"]
    assert steady_window(short) == list(range(5, 21))
    sparse = run(
        iteration_time={1: 1.0, 10: 1.0, 50: 1.0, 60: 1.0, 70: 1.0, 80: 1.0, 90: 1.0}
    ).metrics["iteration-time"]
    assert steady_window(sparse) == [50, 60, 70, 80]  # nothing in 30-45: first four after step 30


def test_missing_metrics_and_unknown_metrics_fail():
    verdict = ci_verdict(
        run(lm_loss=LOSS), run(num_zeros={1: 1.0}), ["lm loss", "num-zeros", "reward"]
    )
    kinds = [(r.metric, r.kind, r.passed) for r in verdict.results]
    assert kinds == [
        ("lm loss", "setup", False),
        ("num-zeros", "setup", False),
        ("reward", "setup", False),
    ]
    assert "missing from the actual" in verdict.results[0].detail
    assert "missing from the golden" in verdict.results[1].detail


def test_config_chooses_metrics_and_nondeterminism():
    default = parse_model_config(
        "ENV_VARS:\n  NVTE_ALLOW_NONDETERMINISTIC_ALGO: 0\nMODEL_ARGS:\n  --x: 1\n", "c"
    )
    assert default.metrics() == ("lm loss", "num-zeros") and not default.allows_nondeterministic()
    custom = parse_model_config(
        'ENV_VARS:\n  NVTE_ALLOW_NONDETERMINISTIC_ALGO: 1\nMETRICS:\n  - "lm loss"\n  # - "x"\n  - iteration-time\n',
        "c",
    )
    assert custom.metrics() == ("lm loss", "iteration-time") and custom.allows_nondeterministic()
    assert parse_model_config("METRICS: []\n", "c").metrics() == ()
