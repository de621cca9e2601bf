"""Type-check one rank of a TP=8 x CP=4 x DP=64 layout (2048 ranks) in a single process.

Run: python docs/examples/grad_fake_layout.py [rank]
"""

import sys
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardcheck as sc


class CopyToRegion(torch.autograd.Function):
    """Megatron's copy-to-tensor-parallel-region: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


rank = int(sys.argv[1]) if len(sys.argv) > 1 else 0
dist.init_process_group("fake", rank=rank, world_size=2048)
device_mesh = init_device_mesh("cpu", (64, 4, 8), mesh_dim_names=("dp", "cp", "tp"))
tp = device_mesh.get_group("tp")
model = nn.Sequential(OrderedDict(norm=nn.LayerNorm(64), up=nn.Linear(64, 256 // 8, bias=False)))

with sc.typecheck(sc.Mesh.from_device_mesh(device_mesh), mode="collect"):
    sc.annotate_parameters(model, {"up.weight": {"tp": sc.S(0)}}, tp=sc.R, cp=sc.R, dp=sc.R)
    tokens = sc.annotate(torch.randn(128, 64), tp=sc.R, cp=sc.S(0), dp=sc.V)
    model.up(CopyToRegion.apply(model.norm(tokens), tp)).relu().pow(2).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=device_mesh.get_group("dp"))  # but not over cp
    sc.check_gradients(model)
