"""Sequence parallelism: each rank normalises its own slice of the tokens.

Run: torchrun --standalone --nproc-per-node 2 docs/examples/grad_sp_norm.py
"""

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

import shardcheck as sc

dist.init_process_group("gloo")
tp = dist.group.WORLD
torch.manual_seed(0)
model = nn.Sequential(OrderedDict(norm=nn.LayerNorm(8), head=nn.Linear(8, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
tokens = torch.randn(16, 8).chunk(dist.get_world_size())[dist.get_rank()]

with sc.typecheck(sc.Mesh(tp=tp)):
    sc.annotate_parameters(model, tp=sc.R)
    loss = model(sc.annotate(tokens, tp=sc.S(0))).pow(2).sum()  # P: this rank's share of the sum
    loss.backward()
    for p in model.head.parameters():
        dist.all_reduce(p.grad, group=tp)  # the norm's gradients are forgotten
    optimizer.step()
