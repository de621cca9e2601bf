"""An even all-to-all of a shard of a dim past the first, and its rows put back together.

Rank k of an all-to-all receives dim-0 block k of every rank's tensor, in rank order. Given
this rank's piece of a tensor cut along dim d != 0 over the group's one axis (S(d)), block j
of what rank k receives is rank j's piece (its columns) of rows block k: on its own a value no
placement says (V). Cut into those blocks along dim 0 again and joined along d in order (Megatron's
``all_to_all_hp2sp``, Mamba's ``hp2cp``; the backward of ``all_to_all_sp2hp``), they are rows
block k of the whole tensor: S(0). The collective marks its output (``_sc_exchanged``); the
``cat`` rule asks :func:`rejoined_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardcheck.typecheck.rules import Pl, axis_stride, chunk_dim, norm_dim
from shardcheck.typecheck.types import S, Shard, V


@dataclass(frozen=True)
class Exchanged:
    """The output of an even all-to-all over mesh axis ``axis`` (``count`` ranks) of an S(dim)
    input; ``nested``: an axis outside the group, inside (faster than) it, shards dim 0, so the
    group's row blocks would sit inside that axis' rows (a nesting no placement says)."""

    key: tuple
    axis: int
    count: int
    dim: int
    nested: bool


def even_splits(output_splits, input_splits, rows: int, count: int) -> bool:
    """Whether an all-to-all's split sizes (empty: even) cut ``rows`` into ``count`` equal blocks."""
    if rows % count:
        return False
    block = rows // count
    return all(not sizes or list(sizes) == [block] * count for sizes in (output_splits, input_splits))


def mark_exchanged(ctx, output: torch.Tensor, pl: Pl, axes: list[int], inp: torch.Tensor, even: bool) -> None:
    """Remember, on ``output``, an even all-to-all over one axis of a shard of dim d != 0."""
    output.__dict__.pop("_sc_exchanged", None)
    if not even or len(axes) != 1 or output._base is not None or inp.dim() < 2:
        return
    (a,) = axes
    p = pl[a]
    if type(p) is not Shard or norm_dim(p.dim, inp.dim()) == 0:
        return
    nested = any(b != a and ctx.sizes[b] > 1 and isinstance(q, Shard) and norm_dim(q.dim, inp.dim()) == 0
                 and axis_stride(ctx, b) < axis_stride(ctx, a) for b, q in enumerate(pl))
    output._sc_exchanged = Exchanged(ctx.key, a, ctx.sizes[a], norm_dim(p.dim, inp.dim()), nested)


def rejoined_rows(ctx, tensors, dim: int) -> Pl | None:
    """The dim-0 blocks of a marked all-to-all output joined along its input's shard dim, in
    order: S(0) on the group's axis (V when nested). The other axes keep the output's types
    (rows of its rows, see ``nested``); one that shards the joined dim keeps its shard when it
    is outside (slower than) the group's axis; inside it, its pieces are joined in another
    order (V)."""
    base = tensors[0]._base
    mark = base.__dict__.get("_sc_exchanged") if base is not None else None
    if mark is None or mark.key is not ctx.key or mark.dim != dim or len(tensors) != mark.count:
        return None
    pl = ctx.types(base)
    if pl is None:
        return None
    first = tensors[0]
    if (any(t._base is not base for t in tensors) or chunk_dim(tensors) != 0
            or first.storage_offset() != base.storage_offset()
            or first.shape[0] * mark.count != base.shape[0] or first.shape[1:] != base.shape[1:]):
        return None
    outer = axis_stride(ctx, mark.axis)
    result = list(pl)
    result[mark.axis] = V if mark.nested else S(0)
    for b, p in enumerate(pl):
        if b != mark.axis and isinstance(p, Shard) and norm_dim(p.dim, first.dim()) == dim:
            result[b] = p if type(p) is Shard and axis_stride(ctx, b) > outer else V
    return tuple(result)


def copy_mark(source: torch.Tensor, target: torch.Tensor) -> None:
    """A waited functional collective's result carries its mark."""
    mark = source.__dict__.get("_sc_exchanged")
    if mark is not None:
        target._sc_exchanged = mark
