"""The list all-gather of a sectioned row shard (rows each rank grouped by expert itself, as
MoE's alltoall dispatcher gathers them over tp with its split sizes).

Piece j is rank j's rows on every rank: no rank's own value (V would let a sum over the ranks
count it once per rank) and, in rank order, no piece of the one-rank rows either. The checker
says nothing of it (unknown); the tensor form's joined rows stay V (see docs/typecheck.md).
"""

import pytest
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks
from shardcheck.typecheck.types import SectionShard


def _program() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):
        rows = sc.annotate(torch.arange(3.0).add(10 * rank).unsqueeze(1), tp=SectionShard(0, (1, 2)))
        pieces = [torch.empty(3, 1) for _ in range(n)]
        dist.all_gather(pieces, rows)
        return {"types": [sc.typeof(p) for p in pieces], "pieces": [p.tolist() for p in pieces],
                "rules": [v.rule for v in sc.violations()]}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_program, 2)


def test_each_piece_is_the_same_on_every_rank_so_no_ranks_own_value(ranks):
    assert ranks[0]["pieces"] == ranks[1]["pieces"]
    assert ranks[0]["pieces"][1] == [[10.0], [11.0], [12.0]]
    for rank in ranks:
        assert rank["types"] == [{}, {}]  # unknown: neither V nor a piece of the one-rank rows
        assert rank["rules"] == []
