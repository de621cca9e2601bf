"""A tensor-parallel MLP with a bug: gelu on the row-parallel output before its all-reduce.

Run: torchrun --standalone --nproc-per-node 2 docs/examples/tp_mlp.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardcheck as sc

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same full weights on every rank
x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
chunk = 16 // world

with sc.typecheck(sc.Mesh(tp=dist.group.WORLD)):
    x, w1, w2 = (sc.annotate(t, tp=sc.R) for t in (x, w1, w2))  # the same on every rank
    w1 = w1[rank * chunk:(rank + 1) * chunk]  # this rank's rows: column-parallel, S(0)
    w2 = w2[:, rank * chunk:(rank + 1) * chunk]  # this rank's columns: row-parallel, S(1)
    h = F.gelu(F.linear(x, w1))
    y = F.linear(h, w2)
    if rank == 0:
        print("w1:", sc.typeof(w1), "w2:", sc.typeof(w2), "h:", sc.typeof(h), "y:", sc.typeof(y))
    try:
        y = F.gelu(y)  # the bug: y is still a partial sum
        dist.all_reduce(y)
    except sc.SpmdTypeError as err:
        if rank == 0:
            print(err)
    if rank == 0:
        print(sc.coverage())
dist.destroy_process_group()
