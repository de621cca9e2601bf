"""A rule re-run after a violation (to type the result V on the broken axis) does not exchange
with the other ranks again: the norm accounting of a one-element SUM all-reduce runs once."""

import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks


def _double_counted_loss() -> dict:
    exchanges = []
    gather = dist.all_gather_object

    def counted(*args, **kwargs):
        exchanges.append(1)
        return gather(*args, **kwargs)

    dist.all_gather_object = counted
    try:
        with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):
            weight = torch.nn.Parameter(torch.ones(2))
            sc.annotate_parameters({"weight": weight}, tp=sc.R)  # named: norm accounting is on
            loss = sc.annotate(torch.tensor([1.5]), tp=sc.R)
            dist.all_reduce(loss)  # a replicated value summed: a double count
            found = {"type": repr(sc.typeof(loss)), "rules": [v.rule for v in sc.violations()]}
    finally:
        dist.all_gather_object = gather
    return {**found, "exchanges": len(exchanges), "value": loss.item()}


def test_a_rule_rerun_after_a_violation_does_not_exchange_again():
    for rank in spawn_ranks(_double_counted_loss, 2):
        assert rank == {"type": "{'tp': R}", "rules": ["double count"], "exchanges": 1, "value": 3.0}


def _fixed_then_by_rank_cuts() -> list[dict]:
    with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):
        x = sc.annotate(torch.arange(8.0) + 10 * dist.get_rank(), tp=sc.V)
        x[0:4].sum()  # a fixed index: rank 0's piece only (reported there, unconfirmed)
        rank = dist.get_rank()
        x[4 * rank:4 * rank + 4].sum()  # this rank's piece of a varying tensor: a real cut by rank
        return [v.as_dict() for v in sc.violations()]


def test_a_rule_rerun_does_not_number_a_cut_again():
    """The re-run of the fixed-index cut on rank 0 must not renumber the cuts after it: the
    by-rank cut is reported by both ranks at the same occurrence, so it is confirmed."""
    per_rank = spawn_ranks(_fixed_then_by_rank_cuts, 2)
    confirmed = sc.confirmed_across_ranks(per_rank)
    assert [(v["rule"], v["occurrence"]) for v in confirmed] == [("split of varying", 2)]
    assert {v["location"] for v in confirmed} == {v["location"] for v in per_rank[1]}
