# mlp_scenario.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardcheck as sc


class ColumnParallel(nn.Module):
    def __init__(self, ctx, weight):
        super().__init__()
        self.weight = nn.Parameter(ctx.shard(weight, sc.S(0), "tp"))

    def forward(self, x):
        return F.linear(x, self.weight)


class RowParallel(nn.Module):
    def __init__(self, ctx, weight, scale=1.0):
        super().__init__()
        self.weight = nn.Parameter(ctx.shard(weight, sc.S(1), "tp"))
        self.group, self.scale = ctx.groups["tp"], scale

    def forward(self, h):
        out = F.linear(h, self.weight) * self.scale
        dist.all_reduce(out, group=self.group)
        return out


def build(ctx, scale=1.0):
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(8, 16), torch.randn(64, 16), torch.randn(16, 64)
    model = nn.Sequential(ColumnParallel(ctx, w1), nn.GELU(), RowParallel(ctx, w2, scale))
    ctx.register(model, prefix="mlp")
    with torch.no_grad():
        out = model(ctx.shard(x, sc.S(0), "dp"))
    return {"out": out}


def mlp(ctx):
    return build(ctx)


def mlp_wrong_scale(ctx):
    # The author believed all_reduce averages, and pre-scaled by 1/tp "to undo it".
    return build(ctx, scale=1.0 / ctx.layout.tp)
