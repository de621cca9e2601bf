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
