"""Row-parallel output fed to gelu before its all-reduce: `shardcheck run -n 2` finds it."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardcheck as sc

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
chunk = 16 // world

with sc.typecheck(sc.Mesh(tp=dist.group.WORLD)):
    x, w1, w2 = (sc.annotate(t, tp=sc.R) for t in (x, w1, w2))
    h = F.gelu(F.linear(x, w1[rank * chunk:(rank + 1) * chunk]))  # column-parallel
    y = F.linear(h, w2[:, rank * chunk:(rank + 1) * chunk])  # row-parallel: partial sums
    y = F.gelu(y)  # bug: all_reduce first
    dist.all_reduce(y)
dist.destroy_process_group()
