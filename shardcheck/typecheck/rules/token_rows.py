"""Rows a rank groups by expert itself: MoE's permutation of its own tokens, and its inverse.

Where the tokens are a row shard (context parallelism), each rank routes its own rows: the
permutation lists, expert after expert, this rank's rows routed to that expert, in row order.
Rows of a shard are in rank order, so the one-rank permutation is the same list with every
expert's section cut over the ranks: the permuted rows are a ``SectionShard`` of dim 0 whose
section lengths are this rank's counts per expert (they differ by rank; a rank's cut at its own
section bounds is a plain shard of that expert's rows).

The index that permutes (the argsort of the flat expert-major routing map, cut to its set
entries, taken modulo the rows; in 0.16 the row positions masked by the map) holds positions
of this rank's own rows; it is marked with the
axes, the counts and the number of rows (the ``grouped`` field of its :mod:`tensor_state`). Reading rows by a marked index
(``index_select``, ``gather``) gives the sectioned rows; adding sectioned rows back by it into
zeros of the rows (``scatter_add``, ``index_add``) gives the row shard again. ``masked_select``
of a value cut along a later dim than its first by a mask cut alike lists its picks in the
same order: a ``SectionShard`` by the mask's counts per leading index, which
``masked_scatter`` into zeros puts back; a rank's own values (V) it puts into zeros stay V.

A flat view of a whole [groups, rows] map sorted so is marked too (with no axes: the rows are
each rank's own). Rows read by a marked index, and a flat group-major value read by the flat
positions, are marked grouped (``routing.mark_rows``): an all-to-all may route them by group.
So are the picks of a [groups, rows] value by a mask of its shape (0.16's permuted
probabilities): a rank's own values picked by its own or a replicated mask are V.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

import torch

from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.rules.common import (
    Refinement,
    RuleContext,
    arg,
    is_partial,
    norm_dim,
    replicated,
)
from shardcheck.typecheck.rules.routing import mark_rows
from shardcheck.typecheck.types import BlockShard, P, R, Route, Routed, S, SectionShard, Shard, V

aten = torch.ops.aten


@dataclass(frozen=True)
class Grouped:
    """An index of this rank's own rows on ``axes``, ``counts`` per group, of ``rows`` rows;
    ``flat``: positions in the flat group-major map (group * rows + row), not yet modulo;
    ``picked``: axes on which the map held this rank's whole groups of replicated rows."""

    key: tuple
    axes: tuple[int, ...]
    counts: tuple[int, ...]
    rows: int
    flat: bool
    picked: tuple[int, ...] = ()


    @property
    def length(self) -> int:
        return sum(self.counts)


def _mark(t: torch.Tensor) -> Grouped | None:
    return tensor_state.read(t, "grouped")


def _grouped(ctx: RuleContext, t: torch.Tensor) -> Grouped | None:
    """The mark of ``t``, or of the 1-D index that ``t`` expands along dim 1."""
    mark = _mark(t)
    base = t._base
    if mark is None and base is not None and t.dim() == 2 and t.stride(1) == 0 and base.dim() == 1 \
            and base.shape[0] == t.shape[0]:
        mark = _mark(base)
    return mark if mark is not None and mark.key is ctx.key else None


def _sections(counts: tuple[int, ...]) -> Shard:
    return S(0) if len(counts) == 1 else SectionShard(0, counts)


def _is_sections(p, counts: tuple[int, ...]) -> bool:
    want = _sections(counts)
    return type(p) is type(want) and p == want


def _sort(base, ctx: RuleContext, args, kwargs, out):
    """A stable descending sort of a flat bool map of groups (the expert-major routing map: cut
    into group blocks over an axis, or a flat view of the [groups, rows] map): its set entries
    come first, group by group."""
    x = args[0]
    pl = base(ctx, args, kwargs, out)
    xl = ctx.types(x)
    if pl is None or xl is None or x.dim() != 1:
        return pl
    blocks = {a: p for a, p in enumerate(xl) if type(p) is BlockShard and p.dim == 0}
    groups = _groups(x, blocks)
    if groups and x.dtype == torch.bool and kwargs.get("stable") and kwargs.get("descending"):
        counts = tuple(int(c) for c in x.view(groups, -1).sum(1))
        picked = () if blocks else _whole_groups(ctx, x)
        tensor_state.write(out[1], "grouped", Grouped(ctx.key, tuple(blocks), counts, x.numel() // groups, True, picked))
    return pl


def _whole_groups(ctx: RuleContext, x: torch.Tensor) -> tuple[int, ...]:
    """Axes on which the [groups, rows] map that ``x`` flattens holds this rank's whole groups."""
    base = x._base
    pl = ctx.types(base) if base is not None and base.dim() == 2 else None
    return () if pl is None else tuple(a for a in range(ctx.n) if _cut_into_groups(ctx, pl, a))


def _cut_into_groups(ctx: RuleContext, pl, a: int) -> bool:
    return type(pl[a]) is Shard and norm_dim(pl[a].dim, 2) == 0 and ctx.sizes[a] > 1


def _picked_rows(counts: tuple[int, ...], rows: int) -> Routed:
    """Rows a rank picked of replicated rows for its whole groups: every row of those groups,
    each on one rank, as if routed to it (one source: all rows are everywhere)."""
    route = Route((counts,), (), ("whole groups", counts, rows))
    return Routed(0, route, route.received, R)


def _all_picked(p, counts: tuple[int, ...], rows: int) -> bool:
    return type(p) is Routed and p.dim == 0 and p == _picked_rows(counts, rows).at(0, p.source)


def _groups(x: torch.Tensor, blocks: dict) -> int:
    """The number of groups of a flat map: its blocks' (one count), else its 2-D base's rows."""
    if blocks:
        outers = {p.outer for p in blocks.values()}
        return outers.pop() if len(outers) == 1 else 0
    base = x._base
    return base.shape[0] if base is not None and base.dim() == 2 and base.numel() == x.numel() else 0


def _slice(base, ctx: RuleContext, args, kwargs, out):
    """The set entries of a sorted map (its first ones) keep its mark, and its type: they are
    cut by count, not by rank (no rank's chunk, even where the count is one)."""
    mark = _mark(args[0])
    if (mark is not None and mark.key is ctx.key and args[0].dim() == 1
            and (arg(args, kwargs, 2, "start", 0) or 0) == 0 and arg(args, kwargs, 4, "step", 1) == 1
            and out.shape[0] == mark.length):
        tensor_state.write(out, "grouped", mark)
        pl = ctx.types(args[0])
        return None if pl is None else tuple(_set_entries(p, a in mark.axes) for a, p in enumerate(pl))
    return base(ctx, args, kwargs, out)


def _set_entries(p, own_rows: bool):
    """On an axis the map's rows were cut over (``own_rows``), the set entries are the rank's
    own: V. A map cut into whole groups (the rank's experts of replicated rows, MoE's allgather
    dispatcher) leaves a rank its groups' entries: an uneven cut this rule cannot say."""
    if not isinstance(p, Shard):
        return p
    return V if own_rows or type(p) is not Shard else None


def _remainder(base, ctx: RuleContext, args, kwargs, out):
    """Flat positions modulo the rows: row positions. Where the map held this rank's whole
    groups, they are its groups' rows of every row, as picked (see :func:`_picked_rows`)."""
    pl = base(ctx, args, kwargs, out)
    mark = _mark(args[0]) if isinstance(args[0], torch.Tensor) else None
    if (mark is None or mark.key is not ctx.key or not mark.flat or not isinstance(args[1], int)
            or args[1] != mark.rows):
        return pl
    tensor_state.write(out, "grouped", replace(mark, flat=False))
    xl = ctx.types(args[0]) or (None,) * ctx.n  # the set entries are unknown where picked
    if not mark.picked or any(p is None or is_partial(p) for a, p in enumerate(xl) if a not in mark.picked):
        return pl
    return tuple(_picked_rows(mark.counts, mark.rows) if a in mark.picked else p for a, p in enumerate(xl))


def _read_by_rows(base, ctx: RuleContext, args, kwargs, out):
    """index_select / gather of the rows of a row shard by a marked index: sectioned rows."""
    pl = base(ctx, args, kwargs, out)
    x, index = args[0], args[2]
    mark = _grouped(ctx, index)
    xl = ctx.types(x)
    if (pl is None or xl is None or mark is None or mark.flat or norm_dim(args[1], x.dim()) != 0
            or x.shape[0] != mark.rows):
        return pl
    mark_rows(out, mark)
    return tuple(_sections(mark.counts) if a in mark.axes and type(xl[a]) is Shard
                 and norm_dim(xl[a].dim, x.dim()) == 0
                 else _picked_rows(mark.counts, mark.rows) if a in mark.picked and xl[a] is R
                 else p for a, p in enumerate(pl))


def _read_flat(base, ctx: RuleContext, args, kwargs, out):
    """A flat group-major value (a transposed map's values) read by the flat positions of its
    set entries: the entries group by group, grouped as the marked rows. Where the value's
    rows are cut as the map's (each group's block cut over the ranks: 0.19's permuted
    probabilities), they are the sectioned rows, as the rows read by the index."""
    pl = base(ctx, args, kwargs, out)
    x, indices = args[0], args[1]
    mark = _flat_positions(ctx, indices, x)
    if mark is None:
        return pl
    mark_rows(out, mark)
    xl = ctx.types(x)
    if pl is None or xl is None:
        return pl
    return tuple(_sections(mark.counts) if a in mark.axes and _blocks_of_groups(xl[a], mark) else p
                 for a, p in enumerate(pl))


def _flat_positions(ctx: RuleContext, indices, flat: torch.Tensor) -> Grouped | None:
    """The mark of ``indices`` where they are one tensor of a sorted map's flat positions into
    ``flat``, a flat value of the map's shape (1-D, one block of rows per group), else None."""
    mark = _mark(indices[0]) if len(indices) == 1 and isinstance(indices[0], torch.Tensor) else None
    if (mark is None or mark.key is not ctx.key or not mark.flat or flat.dim() != 1
            or flat.shape[0] != len(mark.counts) * mark.rows):
        return None
    return mark


def _blocks_of_groups(p, mark: Grouped) -> bool:
    """Whether ``p`` cuts a flat value into one block per group, each cut over the ranks."""
    return type(p) is BlockShard and p.dim == 0 and p.outer == len(mark.counts)


def _put_flat_back(base, ctx: RuleContext, args, kwargs, out):
    """Sectioned entries put by their flat positions into zeros of the flat map (the backward
    of :func:`_read_flat`): the flat value again, each group's block cut over the ranks."""
    pl = base(ctx, args, kwargs, out)
    zeros, indices, values = args[0], args[1], args[2]
    mark = _flat_positions(ctx, indices, zeros)
    vl = ctx.types(values) if isinstance(values, torch.Tensor) else None
    if vl is None or mark is None or not ctx.zero(zeros):
        return pl
    return tuple(BlockShard(0, len(mark.counts)) if a in mark.axes and _is_sections(vl[a], mark.counts) else p
                 for a, p in enumerate(pl or (None,) * ctx.n))


def _add_rows_back(base, ctx: RuleContext, args, kwargs, out):
    """Sectioned rows added by their marked index into zeros of the rows: the row shard. Rows
    picked for a rank's whole groups added back so: its groups' share of every row (P)."""
    pl = base(ctx, args, kwargs, out)
    zeros, index, source = args[0], args[2], args[3]
    mark = _grouped(ctx, index)
    sl = ctx.types(source) if isinstance(source, torch.Tensor) else None
    if (pl is None or sl is None or mark is None or mark.flat or not ctx.zero(zeros)
            or norm_dim(args[1], zeros.dim()) != 0 or zeros.shape[0] != mark.rows):
        return pl
    return tuple(S(0) if a in mark.axes and _is_sections(sl[a], mark.counts)
                 else P if a in mark.picked and _all_picked(sl[a], mark.counts, mark.rows)
                 else p for a, p in enumerate(pl))


def _mask_counts(mask: torch.Tensor, dim: int) -> tuple[int, ...]:
    return tuple(int(c) for c in mask.reshape(prod(mask.shape[:dim]), -1).sum(1))


def _cut_alike(ctx: RuleContext, a: int, tensors, shape) -> int | None:
    """The dim (past the first) every tensor of ``shape`` is cut along on axis ``a``."""
    dims = set()
    for t in tensors:
        p = ctx.types(t)[a]
        if type(p) is not Shard or t.shape != shape:
            return None
        dims.add(norm_dim(p.dim, t.dim()))
    return dims.pop() if len(dims) == 1 and min(dims) > 0 else None


def _masked(base, ctx: RuleContext, args, kwargs, out):
    """masked_select of a value cut along a later dim by a mask cut alike: the picks of each
    leading index in turn, each cut over the ranks. masked_scatter of such picks into zeros
    by that mask: the value cut along that dim again. A rank's own values (V: a gradient of
    its own part of the loss) put into zeros, or values put where a rank's own mask says, are
    a rank's own values: V (summed over the ranks, as DDP sums gradients, a global value)."""
    pl = base(ctx, args, kwargs, out)
    x, mask = args[0], args[1]
    if pl is None or ctx.types(mask) is None:
        return pl
    scatter = len(args) > 2
    if not scatter and _row_positions(x):
        return _mark_positions(ctx, x, mask, out, pl)
    grouped = not scatter and _by_groups(ctx, x, mask)
    if grouped:
        mark_rows(out, _positions_mark(ctx, x, mask))
    result = list(pl)
    for a, p in enumerate(pl):
        picks = _picks_of_groups(ctx, a, args, mask, scatter) if _groups_picked(
            ctx, a, x if not scatter else None, mask) else None
        if picks is not None:
            result[a] = picks
        elif p is not None:
            continue
        elif grouped and _own(ctx.types(x), ctx.types(mask), a):
            result[a] = V  # a rank's own values (probabilities) by its own or a replicated map
        elif not scatter and ctx.types(x) is not None:
            dim = _cut_alike(ctx, a, (x, mask), x.shape)
            if dim is not None:
                result[a] = _sections(_mask_counts(mask, dim))
        elif scatter and ctx.zero(x) and ctx.types(args[2]) is not None:
            dim = _cut_alike(ctx, a, (mask,), x.shape)
            source, where = ctx.types(args[2])[a], ctx.types(mask)[a]
            if dim is not None and _is_sections(source, _mask_counts(mask, dim)):
                result[a] = S(dim)
            elif V in (source, where) and source is not None and not is_partial(source):
                result[a] = V  # a rank's own values, or values put at a rank's own places
    return tuple(result)


def _groups_picked(ctx: RuleContext, a: int, x: torch.Tensor | None, mask: torch.Tensor) -> bool:
    """Whether the [groups, rows] mask (and the value it picks from) hold this rank's whole
    groups on axis ``a`` (MoE's allgather dispatcher: its local experts' columns, transposed)."""
    tensors = (mask,) if x is None else (mask, x)
    return mask.dim() == 2 and all(t.shape == mask.shape and ctx.types(t) is not None
                                   and _cut_into_groups(ctx, ctx.types(t), a) for t in tensors)


def _picks_of_groups(ctx: RuleContext, a: int, args, mask: torch.Tensor, scatter: bool):
    """masked_select of a rank's whole groups by their mask: the picked rows of those groups
    (see :func:`_picked_rows`); masked_scatter of such picks into zeros: the groups again
    (None for any other source: a mask cut along its rows is typed as before)."""
    counts, rows = _mask_counts(mask, 1), mask.shape[1]
    if not scatter:
        return _picked_rows(counts, rows)
    source = ctx.types(args[2]) if isinstance(args[2], torch.Tensor) else None
    if ctx.zero(args[0]) and source is not None and _all_picked(source[a], counts, rows):
        return S(0)
    return None


def _row_positions(x: torch.Tensor) -> bool:
    """``arange(rows)`` repeated for every group: ``arange(n).unsqueeze(0).expand(groups, -1)``."""
    return (x.dim() == 2 and x.stride(0) == 0 and not x.is_floating_point()
            and torch.equal(x[0], torch.arange(x.shape[1], dtype=x.dtype)))


def _positions_mark(ctx: RuleContext, x, mask) -> Grouped:
    """The mark of the picks of a [groups, rows] ``x`` by its mask: this rank's own rows on the
    axes the mask is cut along the rows, and on those it holds whole groups of replicated rows."""
    xl, ml = ctx.types(x), ctx.types(mask)
    axes = tuple(a for a in range(ctx.n) if _cut_alike(ctx, a, (mask,), x.shape) == 1
                 and xl[a] is not None and not is_partial(xl[a]))
    picked = tuple(a for a in range(ctx.n) if xl[a] is R and _cut_into_groups(ctx, ml, a))
    return Grouped(ctx.key, axes, _mask_counts(mask, 1), x.shape[1], False, picked)


def _own(xl, ml, a: int) -> bool:
    """Whether the picks on axis ``a`` are a rank's own: a varying mask or value, the other
    varying or replicated."""
    both = (xl[a], ml[a])
    return V in both and all(p is V or (p is not None and replicated(p)) for p in both)


def _mark_positions(ctx: RuleContext, x, mask, out, pl):
    """The positions of a mask's set entries, group by group (0.16's permute): an index of
    this rank's own rows, cut so on the axes the mask is cut along the rows (V: each rank's own
    positions), V where the mask is a rank's own (V), and its groups' rows of every row where
    the mask holds this rank's whole groups (see :func:`_picked_rows`)."""
    xl, ml = ctx.types(x), ctx.types(mask)
    if xl is None:
        return pl
    mark = _positions_mark(ctx, x, mask)
    tensor_state.write(out, "grouped", mark)
    return tuple(V if a in mark.axes or _own(xl, ml, a)
                 else _picked_rows(mark.counts, mark.rows) if a in mark.picked else p for a, p in enumerate(pl))


def _by_groups(ctx: RuleContext, x, mask) -> bool:
    """A typed [groups, rows] value picked by a typed mask of its shape (a transposed routing
    map: the picks are grouped as the positions it gives)."""
    return (x.dim() == 2 and mask.shape == x.shape and ctx.types(x) is not None
            and not any(_groups_picked(ctx, a, x, mask) for a in range(ctx.n)))


RULES_BY_OP: dict = {}
REFINEMENTS = (
    Refinement((aten.sort,), _sort, "sort"),
    Refinement((aten.slice,), _slice, "slice"),
    Refinement((aten.remainder,), _remainder, "remainder"),
    Refinement((aten.index_select, aten.gather), _read_by_rows, "index_select"),
    Refinement((aten.index.Tensor,), _read_flat, "index"),
    Refinement((aten.index_put, aten.index_put_), _put_flat_back, "index_put"),
    # on index_add and scatter_add: backward's refinement, chained
    Refinement((aten.index_add, aten.index_add_, aten.scatter_add, aten.scatter_add_), _add_rows_back),
    Refinement((aten.masked_select, aten.masked_scatter, aten.masked_scatter_), _masked, "masked_select"),
)
