"""The global tensor from each rank's piece."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather(tensor, dim, group):
    """The global tensor from each rank's piece along ``dim`` over ``group``."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
