"""Checker rules the Megatron audit needed (in shardcheck/typecheck/rules.py), on real Gloo ranks."""

import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks


def _types_of_program():
    group = dist.new_group([0, 1])
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    found = {}
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        sc.annotate(x, tp=sc.S(-1))
        top = torch.max(x, dim=-1)[0]
        found["max over S(-1) along -1"] = sc.typeof(top)["tp"]
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        found["then MAX all-reduce"] = sc.typeof(top)["tp"]
        flat = x.view(-1, 8)
        picked = flat[torch.arange(8), torch.zeros(8, dtype=torch.long)]
        found["index along the sharded dim"] = sc.typeof(picked)["tp"]
        picked[torch.arange(8) < 4] = 0.0
        found["index_put of a scalar keeps it"] = sc.typeof(picked)["tp"]
        found["zeros_like of a shard"] = sc.typeof(torch.zeros_like(x))["tp"]
        scores = torch.baddbmm(torch.empty(8, 2, 2), x.view(8, 1, 8).expand(8, 2, 8),
                               x.view(8, 8, 1).expand(8, 8, 2), beta=0.0)
        found["baddbmm with beta=0"] = sc.typeof(scores)["tp"]
        weight, tokens = torch.randn(16, 4), torch.zeros(2, 3, dtype=torch.long)
        sc.annotate(weight, tp=sc.R)
        sc.annotate(tokens, tp=sc.S(1))
        found["replicated table indexed by sharded tokens"] = sc.typeof(weight[tokens])["tp"]
        ids = sc.annotate(torch.tensor([[1, -200, 3], [4, 5, -200]]), tp=sc.R)
        rows, cols = torch.where(ids != -200)
        found["torch.where of a replicated mask"] = sc.typeof(rows)["tp"]
        found["its second index (unbind of a [n, tp size] tensor)"] = sc.typeof(cols)["tp"]
        found["nonzero of a shard"] = sc.typeof(torch.nonzero(x > 0))["tp"]
        mean_log = x.log_softmax(0).mean(dim=-1)
        (top - mean_log).sum()
    return {k: repr(v) for k, v in found.items()}, [v.rule for v in sc.violations()]


def test_rules_for_megatron_cross_entropy_and_router_patterns():
    ranks = spawn_ranks(_types_of_program, 2)
    assert ranks[0] == ranks[1]  # the program is the same on both ranks: so are its types
    types, rules = ranks[0]
    assert types == {
        "max over S(-1) along -1": "V", "then MAX all-reduce": "R",
        "index along the sharded dim": "V", "index_put of a scalar keeps it": "V",
        "zeros_like of a shard": "S(-1)", "baddbmm with beta=0": "P",
        "replicated table indexed by sharded tokens": "S(1)",
        "torch.where of a replicated mask": "R",
        "its second index (unbind of a [n, tp size] tensor)": "R", "nonzero of a shard": "V",
    }
    assert rules == ["mean over shard"]  # R minus a mean over one rank's vocabulary shard
