"""Correct and buggy training steps on real Gloo ranks, typed by the checker.

Each buggy case names the broken rule, the parameter and the axis, and its gradient (or
gradient norm) really differs from the single-process reference; each correct case matches the
reference and has no violation. The cases run two spawns: one on 2 ranks, one on 4.
"""

import grad_programs as programs
import pytest

from shardcheck.parity.launch import spawn_ranks

EXACT = 1e-5
UNREDUCED, MISDECLARED, ACCOUNTING = "unreduced gradient", "misdeclared parameter", "norm accounting"

TWO_RANKS = {
    "sp_reduced": (programs.sequence_parallel_mlp, True),
    "sp_unreduced": (programs.sequence_parallel_mlp, False),
    "head_scale_S": (programs.per_head_scale, "S(0)"),
    "head_scale_R": (programs.per_head_scale, "R"),
    "counted_everywhere": (programs.per_head_scale, "S(0)", False),
    "head_scale_S_foreach": (programs.per_head_scale, "S(0)", True, True),
    "head_scale_R_foreach": (programs.per_head_scale, "R", True, True),
    "dp_reduced": (programs.data_parallel, True),
    "dp_missing": (programs.data_parallel, False),
    "dp_ep_reduced": (programs.data_parallel, True, ("dp", "ep")),
    "dp_ep_missing": (programs.data_parallel, False, ("dp", "ep")),
    "zeros_counted_once": (programs.zero_count, True),
    "zeros_counted_everywhere": (programs.zero_count, False),
}
FOUR_RANKS = {
    "sp_reduced": (programs.sequence_parallel_mlp, True),
    "q_norm_summed": (programs.head_norm, True),
    "q_norm_not_summed": (programs.head_norm, False),
    "flat_all": (programs.flat_buffer, "all"),
    "flat_short": (programs.flat_buffer, "short"),
}


@pytest.fixture(scope="module")
def two():
    return spawn_ranks(programs.run_cases, 2, TWO_RANKS, timeout=300)


@pytest.fixture(scope="module")
def four():
    return spawn_ranks(programs.run_cases, 4, FOUR_RANKS, timeout=300)


def each_rank(results, case):
    """The case's result on every rank: each rank checks its own gradients, and each must hold."""
    return [rank[case] for rank in results]


def gradient_findings(out):
    return {v for v in out["violations"] if v[0] in (UNREDUCED, MISDECLARED, ACCOUNTING)}


@pytest.mark.slow
@pytest.mark.parametrize("ranks", ["two", "four"])
def test_sequence_parallel_norm_grads_all_reduced(ranks, request):
    for out in each_rank(request.getfixturevalue(ranks), "sp_reduced"):
        assert max(out["norm_diff"], out["fc1_diff"], out["fc2_diff"]) < EXACT
        assert out["violations"] == []


@pytest.mark.slow
def test_sequence_parallel_norm_grads_not_reduced(two):
    for out in each_rank(two, "sp_unreduced"):
        assert out["norm_diff"] > 1e-2 and out["fc1_diff"] < EXACT
        assert gradient_findings(out) == {(UNREDUCED, "norm.weight", "tp"), (UNREDUCED, "norm.bias", "tp")}


@pytest.mark.slow
def test_head_norm_grad_summed_over_tp(four):
    for out in each_rank(four, "q_norm_summed"):
        assert out["q_norm_diff"] < EXACT
        assert out["returned"] == [] and out["violations"] == []


@pytest.mark.slow
def test_head_norm_grad_not_summed(four):
    for out in each_rank(four, "q_norm_not_summed"):
        assert out["q_norm_diff"] > 1e-3 and out["q_proj_diff"] < EXACT
        expected = [(UNREDUCED, "q_norm.weight", "tp"), (UNREDUCED, "q_norm.bias", "tp")]
        assert out["returned"] == expected and out["violations"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("clip", ["", "_foreach"])
def test_per_head_parameter_declared_sharded(two, clip):
    for out in each_rank(two, "head_scale_S" + clip):
        assert out["norm"] == pytest.approx(out["ref_norm"], rel=1e-6)
        assert out["head_scale_diff"] < 1e-7
        assert out["violations"] == []


@pytest.mark.slow
@pytest.mark.parametrize("clip", ["", "_foreach"])
def test_per_head_parameter_declared_replicated(two, clip):
    for out in each_rank(two, "head_scale_R" + clip):
        assert abs(out["norm"] - out["ref_norm"]) > 1e-4 * out["ref_norm"]
        assert out["head_scale_diff"] > 1e-6
        assert gradient_findings(out) == {(MISDECLARED, "head_scale", "tp"),
                                          (ACCOUNTING, "head_scale", "tp")}


@pytest.mark.slow
def test_replicated_parameters_counted_on_every_rank(two):
    for out in each_rank(two, "counted_everywhere"):
        assert abs(out["norm"] - out["ref_norm"]) > 1e-2 * out["ref_norm"]
        replicated = ["out_norm.weight", "q_norm.bias", "q_norm.weight"]
        assert out["violations"] == [(ACCOUNTING, name, "tp") for name in replicated]


@pytest.mark.slow
def test_zero_count_with_replicas_counted_once_is_the_one_process_count(two):
    for out in each_rank(two, "zeros_counted_once"):
        assert out["zeros"] == out["reference"] > 0
        assert out["violations"] == []


@pytest.mark.slow
def test_zero_count_with_replicas_counted_on_every_rank_is_flagged(two):
    replicated = ["out_norm.weight", "q_norm.bias", "q_norm.weight"]
    for out in each_rank(two, "zeros_counted_everywhere"):
        assert out["zeros"] > out["reference"]  # each replicated gradient's two zeros counted twice
        assert out["violations"] == [(ACCOUNTING, name, "tp") for name in replicated]


@pytest.mark.slow
def test_data_parallel_gradients_averaged(two):
    for out in each_rank(two, "dp_reduced"):
        assert out["max_diff"] < EXACT and out["violations"] == []


@pytest.mark.slow
def test_data_parallel_all_reduce_missing(two):
    for out in each_rank(two, "dp_missing"):
        assert out["max_diff"] > 1e-2
        names = ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert out["violations"] == [(UNREDUCED, name, "dp") for name in names]


@pytest.mark.slow
def test_an_all_reduce_over_two_axes_with_the_same_ranks_reduces_over_both(two):
    """dp and ep over one group (Megatron at dp2-ep2): the dp all-reduce is the ep one too."""
    for out in each_rank(two, "dp_ep_reduced"):
        assert out["max_diff"] < EXACT and out["violations"] == []
    for out in each_rank(two, "dp_ep_missing"):
        assert out["max_diff"] > 1e-2
        names = ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert out["violations"] == [(UNREDUCED, name, axis) for name in names for axis in ("dp", "ep")]


@pytest.mark.slow
@pytest.mark.parametrize("reduced", ["all", "short"])
def test_flat_buffer_reduced_in_place(four, reduced):
    for out in each_rank(four, f"flat_{reduced}"):
        wrong = {name for name, diff in out["diffs"].items() if diff > EXACT}
        if reduced == "all":
            assert wrong == set() and out["violations"] == []
        else:
            assert wrong == {"out_norm.weight"}
            assert out["violations"] == [(UNREDUCED, "out_norm.weight", "dp")]
