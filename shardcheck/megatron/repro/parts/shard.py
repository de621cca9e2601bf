"""This rank's sequence chunk under sequence parallelism."""

from __future__ import annotations


def shard(tensor, sizes, group):
    """This rank's sequence chunk (dim 0) under sequence parallelism, else the whole tensor."""
    return tensor.chunk(group.size())[group.rank()] if sizes["sp"] else tensor
