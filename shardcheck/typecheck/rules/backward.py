"""Rules for loss kernels and backward kernels that the base table lacks, by op (see
:mod:`registry`). Each backward kernel is linear in its incoming gradient and non-linear in
the saved forward values.
"""

from __future__ import annotations

import torch

from shardcheck.typecheck.rules.arithmetic import MUL, NL, _reduce_axis, elementwise
from shardcheck.typecheck.rules.common import (
    Refinement,
    RuleContext,
    arg,
    inside,
    interleaves,
    norm_dim,
    replicated,
    shift_shards,
)
from shardcheck.typecheck.rules.indexing import _along_dim_rule
from shardcheck.typecheck.rules.shape import rank_chunks
from shardcheck.typecheck.types import (
    InterleavedShard,
    P,
    Placement,
    RankChunk,
    Routed,
    S,
    SectionShard,
    Shard,
    V,
)

aten = torch.ops.aten
_REDUCTION_KIND = {1: "mean", 2: "sum"}  # at::Reduction: 0 none, 1 mean, 2 sum


def _pointwise_loss(ctx: RuleContext, args, kwargs, out, reduction_pos: int = 2):
    """mse_loss / l1_loss / smooth_l1_loss / huber_loss(self, target, reduction, ...)."""
    pl = elementwise(ctx, [(args[0], NL), (args[1], NL)])
    kind = _REDUCTION_KIND.get(arg(args, kwargs, reduction_pos, "reduction", 1))
    if pl is None or kind is None:
        return pl
    every_dim = set(range(args[0].dim()))
    return tuple(_reduce_axis(kind, p, a, every_dim, False) for a, p in enumerate(pl))


def _pointwise_loss_backward(ctx: RuleContext, args, kwargs, out):
    """*_loss_backward(grad, self, target, reduction, ...): linear in grad."""
    return elementwise(ctx, [(args[0], MUL), (args[1], NL), (args[2], NL)])


def _logits_loss(ctx: RuleContext, args, kwargs, out):
    """binary_cross_entropy_with_logits(self, target, weight, pos_weight, reduction)."""
    return _pointwise_loss(ctx, args, kwargs, out, reduction_pos=4)


def _slice_backward(ctx: RuleContext, args, kwargs, out):
    """slice_backward(grad, input_sizes, dim, start, end, step): grad padded with zeros. The
    gradient of this rank's chunk on an axis that cuts the dim (a rank slice), put at that
    chunk's place, is a partial sum there; a shard whose pieces hold that axis' is whole again,
    whichever of the two is the faster in rank order (see :func:`inside`). Routed rows taken
    from the front of padded ones get their padding rows back, as zeros. Any other shard of
    the dim: V."""
    pl = ctx.types(args[0])
    if pl is None:
        return None
    ndim = len(args[1])
    dim = norm_dim(args[2], ndim)
    along = [b for b, p in enumerate(pl)
             if isinstance(p, Shard) and norm_dim(p.dim, ndim) == dim and ctx.sizes[b] > 1]
    cut = [b for b in along if _padded_at_rank(ctx, b, pl[b], args, dim)
           and all(inside(ctx, pl, b, a) for a in along if a != b)]
    return tuple(_front_rows_gradient(pl[b], args, dim) if b in along and type(pl[b]) is Routed
                 else _slice_gradient(ctx, pl, b, cut, dim, ndim) for b in range(len(pl)))


def _front_rows_gradient(p: Routed, args, dim: int) -> Placement:
    """The gradient of routed rows sliced from the front of a longer tensor (a padded
    expert's output cut back to its rows): the rows, then zeros in the rows left out."""
    total, length = args[1][dim], args[0].shape[dim]
    start = norm_dim(args[3], total) if args[3] is not None else 0
    return p.padded(total - length, zero=True) if start == 0 and args[5] == 1 else V


def _padded_at_rank(ctx: RuleContext, b: int, p, args, dim: int) -> bool:
    total, length = args[1][dim], args[0].shape[dim]
    start = norm_dim(args[3], total) if args[3] is not None else 0
    return (type(p) in (Shard, RankChunk) and args[5] == 1 and length < total
            and (start, length) in rank_chunks(total, ctx.sizes[b], ctx.index[b]))


def _slice_gradient(ctx: RuleContext, pl: tuple, b: int, cut: list[int], dim: int, ndim: int):
    p = pl[b]
    if not isinstance(p, Shard) or norm_dim(p.dim, ndim) != dim:
        return p
    if len(cut) != 1:
        return V
    if b in cut:
        return P
    return S(p.dim) if type(p) is Shard and inside(ctx, pl, cut[0], b) else V


def _select_backward(ctx: RuleContext, args, kwargs, out):
    """select_backward(grad, input_sizes, dim, index): grad placed in a new dim of zeros."""
    pl = ctx.types(args[0])
    if pl is None:
        return None
    ndim = len(args[1])
    dim = norm_dim(args[2], ndim)

    def moved(d: int) -> int:
        d = norm_dim(d, ndim - 1)
        return d + (d >= dim)
    return shift_shards(pl, moved)


_laid_out_like_source = _along_dim_rule(3, 1, 2)


def _add_into(scatter_add, ctx: RuleContext, args, kwargs, out):
    """index_add / scatter_add(self, dim, index, source). Into a known-zero ``self`` (the
    backward of index_select and gather) the result is laid out like the source, and a
    source cut along ``dim`` put in place by each rank's own index (V) stays cut there: every
    rank adds its block's rows into its own block (MoE's unpermute of the tokens a rank
    permuted by its own routing map)."""
    if ctx.zero(args[0]) and isinstance(args[3], torch.Tensor):
        pl = _laid_out_like_source(ctx, args, kwargs, out)
        source, index = ctx.types(args[3]), ctx.types(args[2])
        dim = norm_dim(args[1], args[0].dim())
        return pl if pl is None else tuple(
            S(dim) if p is V and type(s) is Shard and norm_dim(s.dim, args[3].dim()) == dim and i is V
            else _regrouped(s, i, args[2], dim, args[3].dim()) or p
            for p, s, i in zip(pl, source, index, strict=True))
    return scatter_add(ctx, args, kwargs, out)


def _regrouped(s, i, index: torch.Tensor, dim: int, ndim: int) -> SectionShard | None:
    """The backward of an index_select that grouped a sectioned shard's chunks by chunk (see
    InterleavedShard): the gradient added back by the same replicated index is that shard."""
    if type(s) is not InterleavedShard or s.outside or norm_dim(s.dim, ndim) != dim or not replicated(i):
        return None
    sections = tuple(size * s.count for size in s.chunks)
    return SectionShard(dim, sections) if interleaves(index, sections, s.count) else None


_LOSSES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss")
RULES_BY_OP = {
    aten.binary_cross_entropy_with_logits: _logits_loss,
    aten.slice_backward: _slice_backward,
    aten.select_backward: _select_backward,
    **{getattr(aten, loss): _pointwise_loss for loss in _LOSSES},
    **{getattr(aten, loss + "_backward"): _pointwise_loss_backward
       for loss in _LOSSES if hasattr(aten, loss + "_backward")},
}
REFINEMENTS = (
    Refinement((aten.index_add, aten.index_add_, aten.scatter_add, aten.scatter_add_), _add_into,
               "scatter_add"),
)
