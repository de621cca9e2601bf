"""Correct and buggy training steps on real Gloo ranks: numerics against one process."""

import pytest

from shardcheck.launch import spawn_ranks
from tests import grad_programs as programs

EXACT = 1e-5


def last_rank(fn, world_size, *args):
    return spawn_ranks(fn, world_size, *args)[-1]


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_mlp_norm_grads_all_reduced(world_size):
    out = last_rank(programs.sequence_parallel_mlp, world_size, True)
    assert max(out["norm_diff"], out["fc1_diff"], out["fc2_diff"]) < EXACT


def test_sequence_parallel_mlp_norm_grads_not_reduced():
    out = last_rank(programs.sequence_parallel_mlp, 2, False)
    assert out["norm_diff"] > 1e-2 and out["fc1_diff"] < EXACT


def test_head_norm_grad_summed_over_tp():
    out = last_rank(programs.head_norm, 4, True)
    assert out["q_norm_diff"] < EXACT


def test_head_norm_grad_not_summed():
    out = last_rank(programs.head_norm, 4, False)
    assert out["q_norm_diff"] > 1e-3 and out["q_proj_diff"] < EXACT


def test_per_head_parameter_declared_sharded():
    out = last_rank(programs.per_head_scale, 2, "S(0)")
    assert out["norm"] == pytest.approx(out["ref_norm"], rel=1e-6)
    assert out["head_scale_diff"] < 1e-7


def test_per_head_parameter_declared_replicated_breaks_the_norm():
    out = last_rank(programs.per_head_scale, 2, "R")
    assert abs(out["norm"] - out["ref_norm"]) > 1e-4 * out["ref_norm"]
    assert out["head_scale_diff"] > 1e-6


def test_replicated_parameters_counted_on_every_rank_break_the_norm():
    out = last_rank(programs.per_head_scale, 2, "S(0)", False)
    assert abs(out["norm"] - out["ref_norm"]) > 1e-2 * out["ref_norm"]


@pytest.mark.parametrize("reduce", [True, False])
def test_data_parallel_gradient_all_reduce(reduce):
    out = last_rank(programs.data_parallel, 2, reduce)
    assert (out["max_diff"] < EXACT) == reduce


@pytest.mark.parametrize("reduced", ["all", "short"])
def test_flat_buffer_reduced_in_place(reduced):
    diffs = last_rank(programs.flat_buffer, 4, reduced)["diffs"]
    wrong = {name for name, diff in diffs.items() if diff > EXACT}
    assert wrong == (set() if reduced == "all" else {"out_norm.weight"})
