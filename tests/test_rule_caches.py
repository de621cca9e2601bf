"""What the rules remember between op calls, keyed on all their outcome depends on: a
collective's axes per group and mesh, the named parameters a norm compares with."""

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardcheck as sc
from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.checker import Checker
from shardcheck.typecheck.rules.collectives import UnknownAxis, _axes, group_ranks
from shardcheck.typecheck.rules.gradient import named_parameters


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_groups_axes_are_kept_per_mesh(fake_world):
    """One group, two meshes that order their axes otherwise: each its own axis index, every
    time; a group over no axis raises every time."""
    tp, dp, neither = dist.new_group([0, 1]), dist.new_group([0, 2]), dist.new_group([0, 3])
    first = Checker(sc.Mesh(rank=0, tp=[0, 1], dp=[0, 2]))
    second = Checker(sc.Mesh(rank=0, dp=[0, 2], tp=[0, 1]))
    for _ in range(2):
        assert (_axes(first, tp), _axes(first, dp)) == ([0], [1])
        assert (_axes(second, tp), _axes(second, dp)) == ([1], [0])
        with pytest.raises(UnknownAxis):
            _axes(first, neither)
    assert group_ranks(neither) == (0, 3)


def _norm_names(t: torch.Tensor) -> list[str]:
    """The parameters a norm of ``t`` counts (none where ``t`` is no named gradient)."""
    term = tensor_state.read(torch.linalg.vector_norm(t), "norm")
    return [] if term is None else sorted(term.params)


def _named_gradient(name: str) -> nn.Parameter:
    param = nn.Parameter(torch.ones(2, 2))
    param.main_grad = sc.annotate(torch.ones(2, 2), tp=sc.R)
    sc.annotate_parameters({name: param}, tp=sc.R)
    return param


def test_a_norm_finds_gradients_by_the_parameters_named_last():
    """A norm of a gradient names its parameter as last named, finds a parameter named after
    the first norm, and no longer one that died."""
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1])) as checker:
        first = _named_gradient("first")
        assert _norm_names(first.main_grad) == ["first"]
        second = _named_gradient("second")
        assert _norm_names(second.main_grad) == ["second"]
        sc.annotate_parameters({"renamed": first}, tp=sc.R)
        assert _norm_names(first.main_grad) == ["renamed"]
        first.main_grad = sc.annotate(torch.ones(2, 2), tp=sc.R)  # a new gradient tensor
        assert _norm_names(first.main_grad) == ["renamed"]
        grad = second.main_grad
        del second
        gc.collect()
        assert [name for name, _ in named_parameters(checker)] == ["renamed"]
        assert _norm_names(grad) == []


def _grid(rank: int) -> sc.Mesh:
    """Rank ``rank``'s mesh of 4 ranks: tp over neighbours, dp over ranks 2 apart."""
    return sc.Mesh(rank=rank, tp=[rank - rank % 2, rank - rank % 2 + 1], dp=[rank % 2, rank % 2 + 2])


@pytest.mark.parametrize(("mesh", "piece", "types"), [
    (sc.Mesh(rank=0, tp=[0, 1]), slice(0, 4), {"tp": "S(0)"}),
    (sc.Mesh(rank=1, tp=[0, 1]), slice(0, 4), {"tp": "R"}),
    (sc.Mesh(rank=1, tp=[0, 1]), slice(4, 8), {"tp": "S(0)"}),
    (_grid(0), slice(0, 2), {}), (_grid(3), slice(0, 2), {"tp": "R", "dp": "R"}),
    (_grid(3), slice(6, 8), {})])
def test_a_rank_chunk_is_worked_out_per_mesh_and_cut(mesh, piece, types):
    """One cut of replicated rows on the meshes of several ranks: a half of 8 rows is the tp
    rank's chunk (S(0)) on the rank whose half it is, R elsewhere; a quarter, on 4 ranks, its
    chunk of the tp x dp group (both axes unknown) on that rank only."""
    with sc.typecheck(mesh):
        rows = sc.annotate(torch.zeros(8, 2), **dict.fromkeys(mesh.names, sc.R))[piece]
        assert {axis: repr(p) for axis, p in sc.typeof(rows).items()} == types
