"""An even all-to-all of a shard of a dim past the first, and its rows put back together.

Rank k of an all-to-all receives dim-0 block k of every rank's tensor, in rank order. Given
this rank's piece of a tensor cut along dim d != 0 over the group's one axis (S(d)), block j
of what rank k receives is rank j's piece (its columns) of rows block k: on its own a value no
placement says (V). Cut into those blocks along dim 0 again and joined along d in order (Megatron's
``all_to_all_hp2sp``, Mamba's ``hp2cp``; the backward of ``all_to_all_sp2hp``), they are rows
block k of the whole tensor: S(0). The collective marks its output (the ``exchanged`` field of its :mod:`tensor_state`); the
``cat`` rule asks :func:`rejoined_rows`. The list form sent the consecutive dim-0 chunks of
such a shard receives the blocks as separate tensors, each marked with its place
(``exchanged_piece``); joined along d in that order they are S(0) alike.

The other way (``all_to_all_sp2hp``, Mamba's ``cp2hp``): the dim-d chunks of a tensor stacked
on dim 0 and exchanged give rank k chunk k of every rank's rows, S(d) on the group's axis. An
axis that shards dim d of the chunked tensor too holds the group's pieces inside its own:
its shard ``outside`` the group's (see :class:`~shardcheck.typecheck.types.Shard`), which
the rows joined back make plain again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.rules.common import (
    RuleContext,
    axis_stride,
    chunk_dim,
    inside,
    moved,
    norm_dim,
)
from shardcheck.typecheck.types import (
    InterleavedShard,
    Pl,
    Placement,
    S,
    SectionShard,
    Shard,
    V,
    interleaved,
)


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
    source: Pl | None = None  # the list form: the type of the tensor the sent chunks cut
    sections: tuple | None = None  # the input's sections along dim (a SectionShard)


def even_splits(output_splits, input_splits, rows: int, count: int) -> bool:
    """Whether an all-to-all's split sizes (empty: even) cut ``rows`` into ``count`` equal blocks."""
    if rows % count:
        return False
    block = rows // count
    return all(not sizes or list(sizes) == [block] * count for sizes in (output_splits, input_splits))


def mark_exchanged(ctx: RuleContext, output: torch.Tensor, pl: Pl, axes: list[int], inp: torch.Tensor, even: bool) -> None:
    """Remember, on ``output``, an even all-to-all over one axis of a shard of dim d != 0."""
    tensor_state.write(output, "exchanged", None)
    if not even or len(axes) != 1 or output._base is not None or inp.dim() < 2:
        return
    (a,) = axes
    p = pl[a]
    if type(p) not in (Shard, SectionShard) or p.outside or norm_dim(p.dim, inp.dim()) == 0:
        return
    tensor_state.write(output, "exchanged", Exchanged(
        ctx.key, a, ctx.sizes[a], norm_dim(p.dim, inp.dim()), _nested(ctx, pl, a, inp.dim()), None,
        p.sections if type(p) is SectionShard else None))


def rejoined_rows(ctx: RuleContext, tensors, dim: int) -> Pl | None:
    """The dim-0 blocks of a marked all-to-all output joined along its input's shard dim, in
    order: S(0) on the group's axis (V when nested). The other axes keep the output's types
    (rows of its rows, see ``nested``); one that shards the joined dim keeps its shard when it
    is outside (slower than) the group's axis; inside it, its pieces are joined in another
    order (V)."""
    base = tensors[0]._base
    mark = tensor_state.read(base, "exchanged") if base is not None else None
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
    return _rejoined(ctx, mark, pl, dim, first.dim())


def _rejoined(ctx: RuleContext, mark: Exchanged, pl: Pl, dim: int, ndim: int) -> Pl:
    result = list(pl)
    result[mark.axis] = V if mark.nested else S(0)
    for b, p in enumerate(pl):
        if b != mark.axis and isinstance(p, Shard) and norm_dim(p.dim, ndim) == dim:
            result[b] = _joined_outside(ctx, mark, pl, b) if inside(ctx, pl, mark.axis, b) else V
    return tuple(result)


def _joined_outside(ctx: RuleContext, mark: Exchanged, pl: Pl, b: int) -> Placement:
    """Axis ``b``'s shard once the group's pieces inside it are joined: whole again, its
    sections' chunks grouped by chunk where the group's pieces held a piece of each section
    (see InterleavedShard). Sections that do not match the group's: V."""
    p = pl[b]
    if mark.sections is None:
        return moved(p, p.dim, False) if type(p) is Shard else V
    if type(p) is not SectionShard or p.sections != mark.sections:
        return V
    return interleaved(p.dim, p.sections, mark.count)


def columns_inside(ctx: RuleContext, pl: Pl, source: Pl | None, a: int, dim: int, ndim: int) -> tuple[Pl, tuple | None]:
    """The output's types, off the group's axis ``a``, of an even all-to-all of the dim-``dim``
    chunks of a tensor typed ``source`` stacked on dim 0: an axis that shards ``dim`` there
    (plainly) holds a's pieces inside its own, outside them against the mesh order where it
    is the faster one. Of a shard whose sections' chunks are grouped by chunk, one group per
    rank of ``a`` (see InterleavedShard), rank k gets chunk k of each section: both axes hold
    their piece of each section, sections given too. The others keep ``pl``."""
    if source is None:
        return pl, None
    result, sections = list(pl), None
    for b, q in enumerate(source):
        if b == a or not isinstance(q, Shard) or q.outside or norm_dim(q.dim, ndim) != dim:
            continue
        outside = axis_stride(ctx, b) < axis_stride(ctx, a)
        if type(q) is Shard:
            result[b] = S(q.dim, outside)
        elif type(q) is InterleavedShard and q.count == ctx.sizes[a]:
            result[b] = SectionShard(q.dim, q.chunks, outside)
            sections = q.chunks
    return tuple(result), sections


def mark_exchanged_pieces(ctx: RuleContext, outputs, inputs, pl: Pl, axes: list[int]) -> None:
    """Remember, on each of ``outputs``, its place among the blocks an all-to-all (list form)
    received for ``inputs``: the consecutive dim-0 chunks, one per rank, of one tensor that
    is a shard of dim d != 0 over the group's one axis."""
    for t in outputs:
        tensor_state.write(t, "exchanged_piece", None)
    if len(axes) != 1 or len(inputs) != ctx.sizes[axes[0]] or len(outputs) != len(inputs) \
            or inputs[0].dim() < 2 or chunk_dim(inputs) != 0:
        return
    (a,) = axes
    p = pl[a]
    if type(p) is not Shard or p.outside or norm_dim(p.dim, inputs[0].dim()) == 0 or any(
            t.shape != inputs[0].shape for t in outputs):
        return
    source = _chunked(ctx, inputs)
    mark = Exchanged(ctx.key, a, len(inputs), norm_dim(p.dim, inputs[0].dim()),
                     _nested(ctx, source or pl, a, inputs[0].dim()), source)
    for j, t in enumerate(outputs):
        tensor_state.write(t, "exchanged_piece", (mark, j))


def _chunked(ctx: RuleContext, inputs) -> Pl | None:
    """The type of the tensor whose dim-0 chunks ``inputs`` are, all of it, else None."""
    base = inputs[0]._base
    if (base is None or not base.is_contiguous() or base.storage_offset() != inputs[0].storage_offset()
            or base.shape[1:] != inputs[0].shape[1:] or base.shape[0] != inputs[0].shape[0] * len(inputs)):
        return None
    return ctx.types(base)


def _nested(ctx: RuleContext, pl: Pl, a: int, ndim: int) -> bool:
    return any(b != a and ctx.sizes[b] > 1 and isinstance(q, Shard) and norm_dim(q.dim, ndim) == 0
               and axis_stride(ctx, b) < axis_stride(ctx, a) for b, q in enumerate(pl))


def rejoined_pieces(ctx: RuleContext, tensors, dim: int) -> Pl | None:
    """The blocks an all-to-all (list form) received, joined along its input's shard dim in
    their order: as :func:`rejoined_rows`, the other axes as the tensor the sent chunks cut
    holds them (else as the blocks do)."""
    marks = [tensor_state.read(t, "exchanged_piece") for t in tensors]
    if marks[0] is None:
        return None
    mark = marks[0][0]
    if (mark.key is not ctx.key or mark.dim != dim or len(tensors) != mark.count
            or any(m is None or m[0] is not mark or m[1] != j for j, m in enumerate(marks))):
        return None
    pl = ctx.types(tensors[0])
    if pl is None or any(ctx.types(t) != pl for t in tensors):
        return None
    return _rejoined(ctx, mark, mark.source or pl, dim, tensors[0].dim())


def copy_mark(source: torch.Tensor, target: torch.Tensor) -> None:
    """A waited functional collective's result carries its mark."""
    mark = tensor_state.read(source, "exchanged")
    if mark is not None:
        tensor_state.write(target, "exchanged", mark)
