"""Tensors made where the dispatch mode sees no op (shardcheck.typecheck.unseen): the RNG state,
a profiler mark; and what is left as it was after."""

import torch

import shardcheck as sc

MESH = sc.Mesh(rank=0, tp=[0, 1], dp=[0, 2])


def test_the_rng_state_is_varying_on_every_axis_and_comparing_it_is_typed():
    with sc.typecheck(MESH, sites=True):
        state = torch.get_rng_state()
        assert sc.typeof(state) == {"tp": sc.V, "dp": sc.V}
        torch.all(state == torch.random.get_rng_state())
    assert sc.coverage().within(__file__).unknown == 0


def test_a_profiler_mark_is_no_unknown():
    with sc.typecheck(MESH, sites=True):
        x = sc.annotate(torch.ones(2), tp="R", dp="R")
        with torch.autograd.profiler.record_function("step"):
            x * 2
    assert sc.coverage().within(__file__).unknown == 0


def test_outside_a_region_parameters_rng_state_and_data_are_torchs_own():
    with sc.typecheck(MESH):
        with sc.typecheck(MESH):
            pass
        assert torch.get_rng_state is not torch.random.default_generator.get_state  # still patched
        assert sc.typeof(torch.get_rng_state()) == {"tp": sc.V, "dp": sc.V}  # nested exit keeps it
    assert "data" not in torch.Tensor.__dict__
    assert torch.get_rng_state.__module__ == "torch.random"
