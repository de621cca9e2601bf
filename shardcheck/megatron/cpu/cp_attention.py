"""Context-parallel core attention on a CPU, standing in for Transformer Engine's.

megatron-core's own ``DotProductAttention`` refuses ``context_parallel_size > 1``; CP attention
exists only in Transformer Engine (GPU kernels). This stand-in keeps Megatron's torch attention
and adds exactly what CP needs: keys and values are all-gathered over the CP group (the
model's ``pg_collection.cp`` when it was given one, else ``parallel_state``'s; their
gradients summed back), and the causal mask is built from each token's global position in
Megatron's load-balanced chunk order (rank r holds chunks r and 2*cp-1-r). Anything it finds
is a finding about this module, not about Megatron; it is here so the rest of the model runs
under CP.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.dot_product_attention import DotProductAttention

from shardcheck.megatron.checks.typecheck import harness_typed
from shardcheck.typecheck.types import S


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group; the backward sums gradients and keeps this rank's."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=0)[rank], None


def load_balanced_positions(local_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions of this CP rank's tokens: chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``
    (this rank's shard of the positions: S(0) over cp)."""
    return harness_typed(_positions_of(local_len, cp_rank, cp_size), cp=S(0))


def _positions_of(local_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions of any CP rank's tokens, the same on every rank."""
    chunk = local_len // 2
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


class ContextParallelTorchAttention(DotProductAttention):
    """Megatron's torch ``DotProductAttention`` over keys/values gathered across the CP group."""

    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        if config.window_size is not None:
            raise ValueError("sliding-window attention with context parallelism needs Transformer Engine")
        plain = copy.copy(config)
        plain.context_parallel_size = 1
        super().__init__(plain, *args, **kwargs)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        from megatron.core import parallel_state

        group = getattr(self.pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if attention_mask is not None:
            raise ValueError("an explicit attention mask with context parallelism is not supported")
        key = _GatherSequence.apply(key, group)
        value = _GatherSequence.apply(value, group)
        q_pos = load_balanced_positions(query.size(0), rank, size)
        k_pos = torch.cat([_positions_of(query.size(0), r, size) for r in range(size)])
        mask = (k_pos[None, :] > q_pos[:, None])[None, None]
        return super().forward(query, key, value, mask, attn_mask_type, attention_bias,
                               packed_seq_params)


def local_spec_for(config, spec):
    """``spec`` with CP-capable core attention when ``config`` uses context parallelism."""
    attention = getattr(spec.submodules.self_attention, "submodules", None)
    if config.context_parallel_size == 1 or not hasattr(attention, "core_attention"):
        return spec  # a heterogeneous layer's attention may be a linear layer or none
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = ContextParallelTorchAttention
    return spec
