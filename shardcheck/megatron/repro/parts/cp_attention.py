"""Megatron's torch attention over keys and values gathered across CP."""

from __future__ import annotations

import copy

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention


class ContextParallelAttention(DotProductAttention):
    """Megatron's torch attention over keys and values gathered across CP (upstream it is TE only)."""

    def __init__(self, config, *args, **kwargs):
        plain = copy.copy(config)
        plain.context_parallel_size = 1
        super().__init__(plain, *args, **kwargs)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, *args, **kwargs):
        group = self.pg_collection.cp
        size, rank, n = group.size(), group.rank(), query.size(0)
        key, value = (gather_from_sequence_parallel_region(t, group=group) for t in (key, value))

        def positions(r):  # megatron's load-balanced order: rank r holds chunks r and 2*cp-1-r
            return torch.cat([torch.arange(r * n // 2, (r + 1) * n // 2),
                              torch.arange((2 * size - 1 - r) * n // 2, (2 * size - r) * n // 2)])
        mask = torch.cat([positions(r) for r in range(size)])[None, :] > positions(rank)[:, None]
        return super().forward(query, key, value, mask[None, None], attn_mask_type, *args, **kwargs)
