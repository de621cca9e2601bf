"""Axes over the same ranks (Megatron's ep cut from the cp or dp ranks): one rank index.

A rank's chunk of a value replicated on both is its shard on each, and the gather over their
one group gives the value back; the first chunk taken on every rank is wrong where it is not
the rank's own, and flagged there. Axes of the same size over other ranks give no guess.
"""

import pytest
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

ROWS = 3


def _value() -> torch.Tensor:
    return torch.randn(2 * ROWS, 4, generator=torch.Generator().manual_seed(0))


def _program(own_chunk: bool) -> dict:
    rank = dist.get_rank()
    with sc.typecheck(sc.Mesh(cp=dist.group.WORLD, ep=dist.group.WORLD), mode="collect"):
        x = sc.annotate(_value(), cp=sc.R, ep=sc.R)
        start = rank * ROWS if own_chunk else 0
        piece = x[start:start + ROWS] * 2
        cut = {axis: repr(p) for axis, p in sc.typeof(piece).items()}
        pieces = [torch.empty_like(piece) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, piece)
        joined = torch.cat(pieces)
        return {"cut": cut, "joined": {axis: repr(p) for axis, p in sc.typeof(joined).items()},
                "value": joined.tolist(), "rules": [v.rule for v in sc.violations()]}


def _both() -> dict:
    return {own: _program(own) for own in (True, False)}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_both, 2)


def test_a_ranks_chunk_is_its_shard_on_both_axes_and_the_gather_gives_the_value(ranks):
    for rank in ranks:
        mine = rank[True]
        assert mine["cut"] == {"cp": "S(0)", "ep": "S(0)"}
        assert (mine["joined"], mine["rules"]) == ({"cp": "R", "ep": "R"}, [])
        assert torch.tensor(mine["value"]) == pytest.approx(_value() * 2)


def test_the_first_chunk_on_every_rank_is_flagged_where_it_is_wrong(ranks):
    assert torch.tensor(ranks[1][False]["value"]) != pytest.approx(_value() * 2)
    assert ranks[0][False]["cut"] == {"cp": "S(0)", "ep": "S(0)"}
    assert ranks[1][False]["cut"] == {"cp": "R", "ep": "R"}
    assert [rank[False]["rules"] != [] for rank in ranks] == [False, True]


def test_axes_of_one_size_over_other_ranks_give_no_guess():
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1], dp=[0, 2])):
        x = sc.annotate(_value(), tp=sc.R, dp=sc.R)
        assert sc.typeof(x[:ROWS] * 2) == {}  # unknown
    with sc.typecheck(sc.Mesh(rank=0, cp=[0, 1], ep=[0, 1])):
        x = sc.annotate(_value(), cp=sc.R, ep=sc.R)
        assert {a: repr(p) for a, p in sc.typeof(x[:ROWS] * 2).items()} == {"cp": "S(0)", "ep": "S(0)"}
