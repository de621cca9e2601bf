"""Typing rules for indexing ops: index_select, gather, scatter, advanced indexing, masks, and
writes through an index. Part of the rule table (see :mod:`registry`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardcheck.typecheck.rules.arithmetic import join
from shardcheck.typecheck.rules.common import (
    RuleContext,
    arg,
    interleaves,
    is_partial,
    is_tensor,
    norm_dim,
    replicated,
)
from shardcheck.typecheck.rules.contraction import (
    cut_into_rows,
    looked_up_table,
    row_gradient,
)
from shardcheck.typecheck.types import (
    Gathered,
    P,
    Pl,
    Placement,
    R,
    RankChunk,
    S,
    SectionShard,
    Shard,
    V,
    interleaved,
)
from shardcheck.typecheck.violations import Violation


def _along_dim_rule(self_pos: int, dim_pos: int, index_pos: int) -> Callable:
    """index_select / gather / scatter: typed when the indexed dim is not sharded."""
    def rule(ctx: RuleContext, args, kwargs, out):
        x = args[self_pos]
        pl = ctx.types(x)
        il = ctx.types(args[index_pos])
        if pl is None or il is None:
            return None
        dim = norm_dim(args[dim_pos], x.dim())
        result = []
        for a, (p, i) in enumerate(zip(pl, il, strict=True)):
            if p is None or i is None or isinstance(p, Gathered):
                result.append(None)
            elif is_partial(i):
                raise Violation("non-linear on partial", a)
            elif isinstance(p, Shard) and norm_dim(p.dim, x.dim()) == dim:
                result.append(V)
            elif i is V:
                result.append(V)
            else:
                result.append(p)
        return tuple(result)
    return rule


_picked_along = _along_dim_rule(0, 1, 2)


def _index_select_rule(ctx: RuleContext, args, kwargs, out):
    """index_select(x, dim, index), typed as gather is, except where a replicated index groups
    the chunks of a sectioned shard's sections by chunk, as many as an axis has ranks (see
    :class:`InterleavedShard`)."""
    pl = _picked_along(ctx, args, kwargs, out)
    if pl is None:
        return None
    x, index = args[0], args[2]
    dim = norm_dim(args[1], x.dim())
    return tuple(_interleaved_by(ctx, p, q, i, index, dim, x.dim())
                 for p, q, i in zip(pl, ctx.types(x), ctx.types(index), strict=True))


def _interleaved_by(ctx: RuleContext, p, q, i, index: torch.Tensor, dim: int, ndim: int) -> Placement | None:
    if type(q) is not SectionShard or q.outside or norm_dim(q.dim, ndim) != dim or not replicated(i):
        return p
    counts = [n for n in set(ctx.sizes) if n > 1 and interleaves(index, q.sections, n)]
    if len(counts) != 1:
        return p
    return interleaved(dim, tuple(size // counts[0] for size in q.sections), counts[0])


def _scatter_rule(ctx: RuleContext, args, kwargs, out):
    """scatter(self, dim, index, src or value). Into zeros (a one-hot routing map, the
    backward of a gather), the zeros fit the cut of index and source along another dim than
    ``dim`` where the zeros have the index's extent: each rank writes its own rows (of a rank
    chunk, its chunk's rows: topk's backward under a rank-sliced batch); a rank's own values
    (V: the gradient of its own part of the loss) written into zeros stay V."""
    src = args[3] if len(args) > 3 else kwargs.get("src", kwargs.get("value"))
    base = _along_dim_rule(0, 1, 2)(ctx, args, kwargs, out)
    if base is not None and ctx.zero(args[0]):
        base = _rows_written_into_zeros(ctx, args, src, base)
    if base is None or not is_tensor(src):
        return base
    return join(base, ctx.types(src))


def _rows_written_into_zeros(ctx: RuleContext, args, src, base: Pl) -> Pl:
    x, index = args[0], args[2]
    dim = norm_dim(args[1], x.dim())
    il = ctx.types(index)
    sl = ctx.types(src) if is_tensor(src) else None
    def cut_of(t, p) -> int | None:
        return norm_dim(p.dim, t.dim()) if type(p) in (Shard, RankChunk) else None
    result = []
    for a, (p, i) in enumerate(zip(base, il, strict=True)):
        cut = cut_of(index, i)
        if cut is not None and cut != dim and x.shape[cut] == index.shape[cut] and (
                sl is None or (src.dim() == index.dim() and cut_of(src, sl[a]) == cut)):
            chunk = type(i) is RankChunk and (sl is None or type(sl[a]) is RankChunk)
            result.append(RankChunk(cut) if chunk else S(cut))
        elif sl is not None and sl[a] is V and i is not None and not is_partial(i):
            result.append(V)
        else:
            result.append(p)
    return tuple(result)


def _index_rule(ctx: RuleContext, args, kwargs, out):
    """x[i0, i1, ...] with index tensors: indexing a sharded dim gives V (each rank picks from
    its own shard), except a lookup of rows in a row-sharded table by replicated indices,
    which is an embedding lookup (P); a shard after a leading block of indexed dims moves
    with the block."""
    x, indices = args[0], list(args[1])
    pl = ctx.types(x)
    if pl is None:
        return None
    picked = [k for k, idx in enumerate(indices) if idx is not None]
    index_pls = [ctx.types(indices[k]) for k in picked]
    if any(p is None for p in index_pls):
        return None
    index_ndim = out.dim() - (x.dim() - len(picked))
    leading = picked == list(range(len(picked)))
    single_leading = picked == [0]
    result = []
    for a, p in enumerate(pl):
        index_axis = [ip[a] for ip in index_pls]
        if p is None or isinstance(p, Gathered) or any(i is None for i in index_axis):
            result.append(None)
        elif any(is_partial(i) for i in index_axis):
            raise Violation("non-linear on partial", a)
        elif single_leading and type(p) is Shard and norm_dim(p.dim, x.dim()) == 0 \
                and replicated(index_axis[0]):
            # table[indices] is embedding(indices, table): a lookup in a row-sharded table
            # is the masked partial lookup, typed as the embedding rule types it
            result.append(P)
        elif isinstance(p, Shard) and norm_dim(p.dim, x.dim()) in picked:
            result.append(V)
        elif isinstance(p, Shard):
            d = norm_dim(p.dim, x.dim())
            result.append(S(d - len(picked) + index_ndim) if leading else None)
        elif replicated(p) and single_leading and isinstance(index_axis[0], Shard):
            # a replicated table looked up by sharded indices (an embedding): the index dims
            # lead the result, so it is sharded where the indices are
            result.append(S(norm_dim(index_axis[0].dim, indices[0].dim())))
        elif V in index_axis or any(isinstance(i, Shard) for i in index_axis):
            result.append(V if not is_partial(p) else None)
        else:
            result.append(p)
    return tuple(result)


def _nonzero_rule(ctx: RuleContext, args, kwargs, out):
    """nonzero(x) (and ``torch.where(x)``): the positions of x's non-zero entries. The same on
    every rank where x is replicated; a shard's (local positions) or a varying x's differ: V."""
    pl = ctx.types(args[0])
    if pl is None:
        return None
    if any(is_partial(p) for p in pl):
        raise Violation("non-linear on partial", next(a for a, p in enumerate(pl) if is_partial(p)))
    return tuple(None if p is None else R if replicated(p) else V for p in pl)


def _masked_rule(ctx: RuleContext, args, kwargs, out):
    """masked_select(x, mask) and masked_scatter(x, mask, source): elements taken or written in
    row-major order where the (broadcast) mask is set. Replicated in, replicated out; a partial
    x (and source) under a replicated mask stays partial (selection is linear); shards along
    the broadcast shape's first dim give a shard along the result's first dim (each rank's
    picks, in rank order, are the global picks); a varying operand or another cut: unknown (V
    is often a shard whose rows a rank reordered itself, which V would wrongly call varying).
    Zeros scattered into (autograd's backward of masked_select) take the source's cut."""
    operands = [t for t in args[:3] if is_tensor(t)]
    types = [ctx.types(t) for t in operands]
    if any(pl is None for pl in types):
        return None
    ndim = max(t.dim() for t in operands)
    into_zeros = len(operands) == 3 and ctx.zero(operands[0])
    result = []
    for a in range(len(types[0])):
        placements = [pl[a] for pl in types]
        if into_zeros:  # zeros fit the source's replica or partial sum
            placements[0] = placements[2] if replicated(placements[2]) or is_partial(placements[2]) else None
        if any(p is None or isinstance(p, Gathered) for i, p in enumerate(placements)
               if not (i == 0 and into_zeros)):
            result.append(None)
        elif is_partial(placements[1]):
            raise Violation("non-linear on partial", a)
        elif placements[0] is not None and all(replicated(p) for p in placements):
            result.append(R)
        elif replicated(placements[1]) and all(is_partial(p) for i, p in enumerate(placements) if i != 1):
            result.append(P)
        elif _first_dim_cut(operands, placements, ndim):
            result.append(S(0))
        else:  # varying, or picks of a shard cut along another dim (the shard's elements in
            result.append(None)  # another order): nothing the types can say
    return tuple(result)


def _first_dim_cut(operands, placements, ndim: int) -> bool:
    """Every operand cut along the broadcast shape's first dim (a plain shard), or replicated
    and broadcast there (no such dim, or size 1); the source of a scatter (read in order)
    cut along its first dim; zeros scattered into (None here) fit any cut."""
    for i, (t, p) in enumerate(zip(operands, placements, strict=True)):
        lead = 0 if i == 2 else ndim - t.dim()
        if p is None and i == 0:
            continue
        if type(p) is Shard:
            if norm_dim(p.dim, t.dim()) + lead != 0:
                return False
        elif i == 2 or not (replicated(p) and (lead > 0 or t.shape[0] == 1)):
            return False
    return True


def _index_put_rule(ctx: RuleContext, args, kwargs, out):
    """x[idx] = values: a shard stays a shard (each rank writes its own elements); otherwise
    the stored values must have x's placement (zeros fit a partial)."""
    written = _written_rule(ctx, args)
    rows = _rows_of_lookup(ctx, args, kwargs)
    if written is None or not rows:
        return written
    return tuple(rows.get(a, p) for a, p in enumerate(written))


def _rows_of_lookup(ctx: RuleContext, args, kwargs) -> dict[int, Placement | None]:
    """In the backward of ``table[indices]``, the gradient summed into zeros shaped like the
    table. Where the table is cut into rows and the indices are replicated (the masked partial
    lookup, see :func:`_index_rule`), each rank sums into its own rows: by axis, those rows."""
    indices = list(args[1])
    table = looked_up_table("IndexBackward0")
    if table is None or len(indices) != 1 or indices[0] is None or not ctx.zero(args[0]) \
            or not arg(args, kwargs, 3, "accumulate", False):
        return {}
    tl, il, gl = ctx.types(table), ctx.types(indices[0]), ctx.types(args[2])
    if tl is None or il is None or gl is None:
        return {}
    return {a: row_gradient(t, g) for a, (t, i, g) in enumerate(zip(tl, il, gl, strict=True))
            if cut_into_rows(t, table.dim()) and replicated(i)}


def _written_rule(ctx: RuleContext, args):
    xl, values = ctx.types(args[0]), args[2]
    if xl is None:
        return None
    vl = ctx.types(values)
    if vl is None:
        if not ctx.unseen_scalar(values):
            return None
        zero = values.item() == 0
        return tuple(None if is_partial(p) and not zero else p for p in xl)
    result = []
    for p, v in zip(xl, vl, strict=True):
        if (isinstance(p, Shard) or p is V) and not is_partial(v):
            result.append(p)
        elif p == v or (ctx.zero(values) and is_partial(p)):
            result.append(p)
        elif replicated(p) and v is V:
            result.append(V)
        else:
            result.append(None)
    return tuple(result)


RULES: dict[str, Callable] = {
    "index_select": _index_select_rule, "gather": _along_dim_rule(0, 1, 2),
    "scatter": _scatter_rule, "scatter_add": _scatter_rule,
    "index": _index_rule, "index_put": _index_put_rule, "nonzero": _nonzero_rule,
    "masked_select": _masked_rule, "masked_scatter": _masked_rule,
}
"""Indexing rules per op base name."""
