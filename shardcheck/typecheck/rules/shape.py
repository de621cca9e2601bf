"""Typing rules for shape ops: views, slicing by rank, cat/stack, copies (indexing: :mod:`indexing`).

Part of the rule table (see shardcheck.typecheck.rules.registry for the rule protocol).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator

import torch

from shardcheck.typecheck import rank_branches, tensor_state
from shardcheck.typecheck.exchange import rejoined_pieces, rejoined_rows
from shardcheck.typecheck.rules.arithmetic import ADD, Typed, elementwise, reduced_dims
from shardcheck.typecheck.rules.common import (
    RuleContext,
    arg,
    as_pieces,
    axis_stride,
    chunk_dim,
    is_partial,
    is_tensor,
    mark_cut,
    mark_stacked,
    moved,
    norm_dim,
    on_typed_operand,
    outer_of,
    replicated,
    rows_side_by_side,
    shift_shards,
)
from shardcheck.typecheck.rules.contraction import (
    in_backward_of,
)
from shardcheck.typecheck.types import (
    PAVG,
    PEVEN,
    BlockShard,
    Gathered,
    GatheredPiece,
    I,
    P,
    Pl,
    Placement,
    R,
    RankChunk,
    Routed,
    S,
    SectionShard,
    Shard,
    V,
    joined,
)
from shardcheck.typecheck.violations import Violation


def prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def view_shard(in_shape, out_shape, p: Shard, prefer: int | None = None) -> Shard | None:
    """Where a shard lands after a reshape, or None when it cannot be said.

    The ranks' pieces start at a flat offset ``pre`` (the product of the dims before the
    sharded one, times its blocks). An output dim starting exactly there is sharded plainly;
    one that ``pre`` falls inside holds the pieces in blocks (a merge with an inner shard).
    Of several dims starting there (dims of size 1 before it), the one of the piece's length,
    unless ``prefer`` names another (see :func:`_reshaped_back`).
    """
    d, outer = norm_dim(p.dim, len(in_shape)), outer_of(p)
    pre = prod(in_shape[:d]) * outer
    inner = in_shape[d] // outer
    piece = inner * prod(in_shape[d + 1:])
    start, candidates = 1, []
    for j, size in enumerate(out_shape):
        if start == pre:
            candidates.append(j)
        elif start < pre < start * size:
            if candidates or pre % start or piece % prod(out_shape[j + 1:]):
                break
            return BlockShard(j, pre // start, p.outside) if not isinstance(p, SectionShard) else None
        start *= size
    if not candidates:
        return None
    j = prefer if prefer in candidates else next(
        (j for j in candidates if out_shape[j] == inner),
        next((j for j in candidates if out_shape[j] > 1), candidates[0]))
    if isinstance(p, SectionShard):
        return _sections_viewed(p, in_shape, out_shape, d, j)
    return RankChunk(j) if type(p) is RankChunk else S(j, p.outside)  # a guess stays one


def _sections_viewed(p: SectionShard, in_shape, out_shape, d: int, j: int) -> Shard | None:
    """A fused dim ``d`` viewed as dim ``j`` over the same elements: its sections survive where
    each is a whole number of dim-``j`` rows (the fused dim whole, or cut into heads, or heads
    merged into it again); else None. Chunks grouped by chunk survive only whole."""
    rows_in, rows_out = prod(in_shape[d + 1:]), prod(out_shape[j + 1:])
    if out_shape[j] * rows_out != in_shape[d] * rows_in or any(size * rows_in % rows_out for size in p.sections):
        return None
    if rows_in == rows_out:
        return moved(p, j)
    if type(p) is not SectionShard:
        return None
    return SectionShard(j, tuple(size * rows_in // rows_out for size in p.sections), p.outside)


# A view's placements and their other reading (see _other_reading) by (input shape, output
# shape, placements, their types, preferred dims): a model views the same layouts the same way
# in every layer and step. Placements of the types here compare by value (their types are in
# the key: S(0) == RankChunk(0)); others are not kept.
_VIEWED: dict[tuple, tuple[Pl, Pl | None]] = {}
_VIEWED_KEPT = 4096
_VIEWED_TYPES = frozenset({type(None), *(type(p) for p in (R, P, V, I, PAVG, PEVEN)), Shard, RankChunk,
                           GatheredPiece, BlockShard, SectionShard})


@on_typed_operand
def _view_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    in_shape, out_shape = x.shape, out.shape
    if in_shape == out_shape:
        return pl
    prefer = _reshaped_back(ctx, in_shape, out_shape, pl)
    types = tuple(map(type, pl))
    key = (in_shape, out_shape, pl, types, prefer) if _VIEWED_TYPES.issuperset(types) else None
    known = _VIEWED.get(key) if key is not None else None
    if known is None:
        viewed = tuple(view_shard(in_shape, out_shape, p, prefer[a]) if isinstance(p, Shard)
                       else (None if isinstance(p, Gathered) else p) for a, p in enumerate(pl))
        known = viewed, _other_reading(in_shape, out_shape, pl, viewed)
        if key is not None:
            if len(_VIEWED) >= _VIEWED_KEPT:
                _VIEWED.clear()
            _VIEWED[key] = known
    viewed, other = known
    if other is not None:
        tensor_state.write(out, "viewed", (ctx.key, viewed, other))
    return viewed


def _other_reading(in_shape, out_shape, pl: Pl, viewed: Pl) -> Pl | None:
    """The other reading of a view whose shard lands on a dim right after a size-1 dim it
    inserted (remembered on the view's result): ``[s, b, g * X] -> [s, b, 1, X]`` cuts the
    sharded dim into g groups of X with one group on this rank (S on the size-1 dim:
    Megatron's QKV viewed by query groups, one per rank), or puts a dim of one before it (S on
    X: ``[h] -> [1, h, 1, 1]``). Both are the same local tensor; the view takes the second, a
    cut along X the first (see :func:`_read_for_cut`). None where there is no other."""
    other = None
    for a, p in enumerate(viewed):
        if type(p) is Shard and p.dim > 0 and out_shape[p.dim - 1] == 1 and _inserted_before(in_shape, pl[a]):
            other = other or list(viewed)
            other[a] = S(p.dim - 1, p.outside)
    return None if other is None else tuple(other)


def _inserted_before(in_shape, p: Placement) -> bool:
    """Whether the view's input shard ``p`` (of an input of ``in_shape``) has no dim of one
    before it (else the input has read the dims already, and the view only carries them)."""
    d = norm_dim(p.dim, len(in_shape))
    return type(p) is Shard and (d == 0 or in_shape[d - 1] != 1)


def _read_for_cut(ctx: RuleContext, x: torch.Tensor, pl: Pl, dim: int) -> Pl:
    """``x``'s placements for a cut along ``dim``: where a view made ``x`` with a shard on
    ``dim`` that could as well sit on the dim of one before it (see :func:`_other_reading`),
    that reading: a dim the ranks' pieces fill whole is cut into q, k and v of one query group.
    A shard read on ``dim`` would make every piece V."""
    mark = tensor_state.read(x, "viewed")
    if mark is None or mark[0] is not ctx.key or mark[1] != pl:
        return pl
    return tuple(q if isinstance(p, Shard) and p.dim == dim else p for p, q in zip(pl, mark[2], strict=True))


def _reshaped_back(ctx: RuleContext, in_shape, out_shape, pl: Pl) -> tuple:
    """The dims, by axis, that the shards of the forward input of the view (``in_shape`` to
    ``out_shape``) that this one undoes sat on (a gradient reshaped back: GDN's one local head
    repeated, then merged, [1, 2] <-> [2], where the piece's length alone would name the
    repeats); in the forward, remembered. Keyed by the shapes as torch.Size (a tuple: equal to
    and hashed as one)."""
    if torch._C._current_graph_task_id() >= 0:
        return ctx.reshaped.get((in_shape, out_shape), (None,) * len(pl))
    ndim = len(in_shape)
    ctx.reshaped[(out_shape, in_shape)] = tuple([
        (p.dim + ndim if p.dim < 0 else p.dim) if isinstance(p, Shard) else None for p in pl])
    return (None,) * len(pl)


@on_typed_operand
def _permute_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    ndim = x.dim()
    order = [norm_dim(d, ndim) for d in args[1]]
    return shift_shards(pl, lambda d: order.index(norm_dim(d, ndim)))


@on_typed_operand
def _transpose_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    ndim = x.dim()
    if len(args) < 3:  # t()
        d0, d1 = 0, max(ndim - 1, 0)
    else:
        d0, d1 = norm_dim(args[1], ndim), norm_dim(args[2], ndim)
    swap = {d0: d1, d1: d0}
    return shift_shards(pl, lambda d: swap.get(norm_dim(d, ndim), norm_dim(d, ndim)))


@on_typed_operand
def _unsqueeze_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    new = norm_dim(args[1], x.dim() + 1)
    return shift_shards(pl, lambda d: norm_dim(d, x.dim()) + (norm_dim(d, x.dim()) >= new))


@on_typed_operand
def _squeeze_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    ndim = x.dim()
    dims = args[1] if len(args) > 1 else range(ndim)
    dims = [dims] if isinstance(dims, int) else dims
    gone = {norm_dim(d, ndim) for d in dims if x.shape[norm_dim(d, ndim)] == 1}

    def moved(d: int) -> int | None:
        d = norm_dim(d, ndim)
        return None if d in gone else d - sum(1 for g in gone if g < d)
    return shift_shards(pl, moved)


@on_typed_operand
def _expand_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    lead = out.dim() - x.dim()
    return shift_shards(pl, lambda d: norm_dim(d, x.dim()) + lead)


def _cut_along(ctx: RuleContext, pl: Pl, ndim: int, dim: int, pieces: list[tuple[int, int]], total: int,
               by_rank_slice: bool = False) -> list[Pl]:
    """Placements of each piece (start, length) cut from a tensor along ``dim``.

    Cutting along a sharded dim gives V. The rank-slice heuristic: a piece of an R tensor
    whose length is total / axis size and whose start is this rank's index on that axis
    times the length is S(dim) on that axis (Megatron's scatter-to-region idiom). A slice
    (``by_rank_slice``) of a V tensor matching the pattern is a "split of varying". The
    backward of a cat cuts each input's gradient at that input's place, the same on every
    rank: no piece of it is a rank's.
    """
    results = []
    by_position = in_backward_of("CatBackward0")
    for start, length in pieces:
        by_rank = {} if by_position else rank_piece(ctx, pl, dim, total, start, length, by_rank_slice,
                                                   None if by_rank_slice else len(pieces))
        per_axis = []
        for a, p in enumerate(pl):
            if a in by_rank:
                per_axis.append(by_rank[a])
            elif isinstance(p, (SectionShard, Routed)) and norm_dim(p.dim, ndim) == dim:
                section = p.piece(start, length)
                per_axis.append(V if section is None else moved(section, dim))
            elif isinstance(p, Shard) and norm_dim(p.dim, ndim) == dim:
                per_axis.append(_cut_by_rank_inside(ctx, a, p, by_rank))
            elif isinstance(p, Gathered):
                per_axis.append(_gathered_cut(ctx, pl, p, dim, start, length, total))
            else:
                per_axis.append(p)
        results.append(tuple(per_axis))
    return results


def _cut_by_rank_inside(ctx: RuleContext, a: int, p: Shard, by_rank: dict) -> Placement:
    """A plain shard of the dim cut into this rank's chunk on another axis (a rank slice of
    each of axis ``a``'s pieces, Mamba's cp slice of a tp weight): a's pieces hold that axis'
    chunks, outside them (see :class:`Shard`). Any other cut of a shard: V."""
    cut = [b for b, q in by_rank.items() if isinstance(q, Shard)]
    if type(p) is not Shard or p.outside or len(cut) != 1:
        return V
    return S(p.dim, axis_stride(ctx, a) < axis_stride(ctx, cut[0]))


def _gathered_cut(ctx: RuleContext, pl: Pl, p: Gathered, dim: int, start: int, length: int, total: int) -> Placement | None:
    """A cut of gathered blocks (stacked on dim 0, one per rank of the gathered axes): a whole
    block is R (rank k's, the same on every rank: Megatron chunks them to join them along the
    shard dim again); a cut inside a block or across blocks lines up with nothing (V); a cut
    along another dim, unknown."""
    if dim != 0:
        return None
    blocks = prod(ctx.sizes[a] for a, q in enumerate(pl) if isinstance(q, Gathered) and q.dim == p.dim)
    return R if length * blocks == total and start % length == 0 else V


def rank_chunks(total: int, parts: int, index: int) -> set[tuple[int, int]]:
    """(start, length) of piece ``index`` when ``total`` is cut into ``parts`` by rank.

    Equal pieces, ``tensor_split`` (the first ``total % parts`` pieces one longer) and
    ``chunk`` (pieces of ``ceil(total / parts)``, the last one shorter) all count.
    """
    base, extra = divmod(total, parts)
    by_tensor_split = (index * base + min(index, extra), base + (index < extra))
    ceil = -(-total // parts)
    by_chunk = (index * ceil, max(0, min(ceil, total - index * ceil)))
    return {by_tensor_split, by_chunk}


_CHUNKS_BY: list[str] = []  # the axes whose rank chooses the chunks cut inside open rank_chunks_by


@contextlib.contextmanager
def rank_chunks_by(axis: str) -> Iterator[None]:
    """Inside, a piece that is this rank's chunk by its index on several axes of one size is
    the chunk of ``axis`` (and of the axes over its ranks), R on the others: the code cuts by
    that axis' rank (Megatron's local experts, by the ep rank, where tp and dp have its size).
    Without it such a cut is ambiguous and left unknown."""
    _CHUNKS_BY.append(axis)
    try:
        yield
    finally:
        _CHUNKS_BY.pop()


def _chosen_by(ctx: RuleContext, axes: list[int]) -> list[int]:
    """The axes among ``axes`` that the innermost :func:`rank_chunks_by` names, with their
    aliases (axes over the same ranks); all of ``axes`` where it names none of them."""
    if not _CHUNKS_BY or _CHUNKS_BY[-1] not in ctx.names:
        return axes
    ranks = ctx.rank_sets[ctx.names.index(_CHUNKS_BY[-1])]
    return [a for a in axes if ctx.rank_sets[a] == ranks] or axes


def rank_piece(ctx: RuleContext, pl: Pl, dim: int, total: int, start: int, length: int,
               check_varying: bool, parts: int | None = None) -> dict[int, Placement | None]:
    """Axes on which the piece [start, start+length) is this rank's chunk of ``total``.

    The guess needs one candidate axis: when an untyped axis would match too, the cut may be
    by that axis's rank (MoE's local experts, by the ep rank), so no axis is guessed. Of several
    typed ones (cp and dp at a rank whose index is the same on both), the axes whose rank read
    computed the bounds are (:func:`rank_branches.bound_axes`), when one group's.

    The whole dim is no rank's chunk: ``x[:, 0]`` of a dim of size 1 on rank 0 is the tensor;
    nor is a piece of a split into another number of ``parts`` than the axis has ranks (GDN's
    sections [8, 8, 16], whose last is rank 1's half by chance).
    """
    single, pairs = _chunk_axes(ctx, total, start, length, parts)
    by_rank = [a for a in single if replicated(pl[a])]
    if by_rank and _viewed_back_from_a_flat_buffer():
        return {}
    unknown = [a for a in single if pl[a] is None]
    chosen = _chosen_by(ctx, by_rank)
    if chosen != by_rank:  # the named axis chose it: the others hold the piece whole
        by_rank, unknown = chosen, []
    if by_rank and not unknown and len({ctx.rank_sets[a] for a in by_rank}) == 1:
        # one axis, or axes over the same ranks (cp and ep at cp2-dp2-ep2): one rank index
        return dict.fromkeys(by_rank, S(dim) if check_varying else RankChunk(dim))
    if by_rank:  # ambiguous: several axes (some untyped) have the same size and index here,
        # unless the bounds were computed from the rank of one of them (see rank_branches)
        bound = rank_branches.bound_axes(start, start + length)  # a look at the stack: once
        chosen = [a for a in by_rank if a in bound]
        if chosen and not unknown and len({ctx.rank_sets[a] for a in chosen}) == 1:
            return dict.fromkeys(chosen, S(dim) if check_varying else RankChunk(dim))
        return dict.fromkeys(by_rank + unknown)
    if spanning := _cut_by_two_axes(pl, pairs):
        return spanning
    if check_varying and not unknown and any(p is V for p in pl):
        occurrence = ctx.count_varying_cut()
        for a in single:
            if pl[a] is V:
                raise Violation("split of varying", a, occurrence=occurrence)
    return {}


# By (id of the interned mesh key, total, start, length, parts): what rank_piece asks of a cut
# whatever the tensor's type (see _chunk_axes), the same for the same cut in every layer and step.
_CHUNK_AXES: dict[tuple, tuple[tuple[int, ...], tuple[tuple[int, int], ...]]] = {}
_CHUNK_AXES_KEPT = 4096


def _chunk_axes(ctx: RuleContext, total: int, start: int, length: int,
                parts: int | None) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """The axes on whose rank the piece [start, start+length) of ``total`` is this rank's
    chunk, and the pairs of axes (in order) on whose rank in their joint group it is (see
    :func:`_cut_by_two_axes`). Neither the whole dim nor a piece of a split into another number
    of ``parts`` than the ranks is one."""
    key = (id(ctx.key), total, start, length, parts)  # the key holds every axis' ranks and this rank
    known = _CHUNK_AXES.get(key)
    if known is None:
        def chunk(size: int, indices: set[int]) -> bool:
            return (size > 1 and length < total and parts in (None, size)
                    and any((start, length) in rank_chunks(total, size, i) for i in indices))
        sizes, index = ctx.sizes, ctx.index
        single = tuple(a for a in range(len(sizes)) if chunk(sizes[a], {index[a]}))
        pairs = tuple((a, b) for a, b in itertools.combinations([a for a in range(len(sizes)) if sizes[a] > 1], 2)
                      if chunk(sizes[a] * sizes[b], {index[a] * sizes[b] + index[b], index[b] * sizes[a] + index[a]}))
        if len(_CHUNK_AXES) >= _CHUNK_AXES_KEPT:
            _CHUNK_AXES.clear()
        known = _CHUNK_AXES[key] = single, pairs
    return known


# torch's views of a coalesced buffer as the tensors it was flattened from: each at its own place,
# the same on every rank (Megatron's sum of sequence-parallel gradients in one all-reduce)
_POSITIONAL_CUT = torch._utils._unflatten_dense_tensors.__code__


def _viewed_back_from_a_flat_buffer(depth: int = 16) -> bool:
    """Whether the running cut is made by :data:`_POSITIONAL_CUT`: a piece in its place, though
    it may be this rank's chunk by chance (two tensors of one size, two ranks). Frames' code is
    compared by identity: a code object's hash reads all its bytecode and constants, and took
    20-80 µs a walk under Megatron's frames."""
    frame = sys._getframe(1)
    while frame is not None and depth:
        if frame.f_code is _POSITIONAL_CUT:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


@on_typed_operand
def _slice_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    ndim = x.dim()
    dim = norm_dim(arg(args, kwargs, 1, "dim", 0), ndim)
    size = x.shape[dim]
    start = arg(args, kwargs, 2, "start", 0) or 0
    step = arg(args, kwargs, 4, "step", 1)
    start = max(0, min(size, norm_dim(start, size)))
    length = out.shape[dim]
    pl = _read_for_cut(ctx, x, pl, dim)
    if step != 1:
        start = -1  # a strided slice is no rank's chunk
    else:
        mark_cut(ctx, [out], pl, dim, size)
    return _cut_along(ctx, pl, ndim, dim, [(start, length)], size, by_rank_slice=True)[0]


@on_typed_operand
def _select_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    ndim = x.dim()
    dim = norm_dim(args[1], ndim)
    pl = _read_for_cut(ctx, x, pl, dim)
    # one index is no rank's chunk: it equals this rank's index by chance too often (a layer,
    # a microbatch when there are as many as ranks)
    (piece,) = _cut_along(ctx, pl, ndim, dim, [(-1, 1)], x.shape[dim])
    return shift_shards(piece, lambda d: None if d == dim else d - (d > dim))


@on_typed_operand
def _split_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    ndim = x.dim()
    dim = norm_dim(arg(args, kwargs, 2, "dim", 0), ndim)
    pl = _read_for_cut(ctx, x, pl, dim)
    pieces, start = [], 0
    for t in out:
        pieces.append((start, t.shape[dim]))
        start += t.shape[dim]
    ctx.remember_pieces(out, pl)
    mark_cut(ctx, out, pl, dim, x.shape[dim])
    if len(out) > 1 and not in_backward_of("CatBackward0") and any(
            type(p) is Shard and norm_dim(p.dim, ndim) == dim for p in pl):
        ctx.cuts.note(list(out), pl)
    return _cut_along(ctx, pl, ndim, dim, pieces, x.shape[dim])


@on_typed_operand
def _unbind_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    ndim = x.dim()
    dim = norm_dim(arg(args, kwargs, 1, "dim", 0), ndim)
    pl = _read_for_cut(ctx, x, pl, dim)
    ctx.remember_pieces(out, pl)
    pieces = _cut_along(ctx, pl, ndim, dim, [(k, 1) for k in range(len(out))], len(out))
    # a rank-slice guess along the unbound dim has no dim left to shard: the piece of a
    # replicated tensor is what every rank holds, R
    pieces = [tuple(R if isinstance(p, RankChunk) and p.dim == dim else p for p in piece)
              for piece in pieces]
    return [shift_shards(p, lambda d: None if d == dim else d - (d > dim)) for p in pieces]


def _pieces(ctx: RuleContext, tensors, joined_dim: int | None = None) -> list:
    """Operands put back together: rank chunks read as R when other pieces are there. Along
    ``joined_dim`` (cat's) sections are left out: pieces cut differently still line up there.
    A rank chunk cut along another dim than cat's is not put back together: joined side by
    side with other tensors it stays this rank's chunk, lined up with their shards of that dim
    (CP's key gradient, this rank's chunk of the reduced whole, next to the query's); so do
    rank chunks of that dim from several tensors (:func:`_chunk_sections`)."""
    if len(tensors) < 2:
        return [(t, ADD) for t in tensors]
    items, views, chunked = [], None, ()
    for i, t in enumerate(tensors):
        pl = ctx.types(t)
        if pl is not None:
            if joined_dim is None:
                pl = as_pieces(pl)
            else:
                if views is None:  # once per cat: its operands' views, compared pairwise
                    views = [_view_of(u) for u in tensors]
                    chunked = _chunk_sections(ctx, tensors, joined_dim, views)
                repeated = views.count(views[i]) > 1
                pl = tuple(p if a in chunked else
                           S(p.dim, p.outside) if type(p) in (SectionShard, Routed) and norm_dim(p.dim, t.dim()) == joined_dim
                           else _across(p, t.dim(), joined_dim, repeated) for a, p in enumerate(pl))
            t = Typed(pl, tuple(t.shape), ctx.const(t), t)
        items.append((t, ADD))
    return items


def _view_of(t: torch.Tensor) -> tuple:
    """What says which elements ``t`` views, and how: equal for two tensors that view the same
    elements the same way."""
    return (t.untyped_storage().data_ptr(), tuple(t.shape), t.storage_offset(), t.stride())


def _chunk_sections(ctx: RuleContext, tensors, dim: int, views: list) -> set[int]:
    """Axes on which cat joins along ``dim`` this rank's chunks of two or more replicated
    tensors, each once: a split gives a rank one chunk on an axis, so they are no pieces of
    one whole but its parts of each tensor, sections of a fused dim (the gradients of a fused
    column-parallel output's pieces, each gathered over tp in forward: MLA's fused down
    projection)."""
    pls = [ctx.types(t) for t in tensors]
    if any(pl is None for pl in pls) or len(set(views)) < len(views):
        return set()
    return {a for a in range(len(pls[0]))
            if all(type(pl[a]) is RankChunk and norm_dim(pl[a].dim, t.dim()) == dim for pl, t in zip(pls, tensors, strict=True))}


def _across(p, ndim: int, joined_dim: int, repeated: bool = False):
    """A piece's placement when cat joins it along ``joined_dim``: a rank chunk (or gathered
    piece) of that dim is put back together (R), unless the same piece comes again (its
    copies make no whole: V); a gathered piece of another dim lines up with nothing (V); a
    rank chunk of another dim stays a chunk (see _axis_layout)."""
    if not isinstance(p, RankChunk):
        return p
    if norm_dim(p.dim, ndim) == joined_dim:
        return V if repeated else R
    return V if type(p) is GatheredPiece else p


def _cat_rule(ctx: RuleContext, args, kwargs, out):
    tensors = [t for t in args[0] if t.numel() > 0 or t.dim() > 1]
    if not tensors:
        return None
    ndim = out.dim()
    dim = norm_dim(arg(args, kwargs, 1, "dim", 0), ndim)
    pl = elementwise(ctx, _pieces(ctx, tensors, dim))
    if pl is None or len(tensors) == 1:
        return pl
    for a in rows_side_by_side(ctx, tensors, dim):
        raise Violation("mixed shards", a, f"the pieces are the rows of a gathered dim-0 shard, "
                                           f"joined along dim {dim}")
    mark_stacked(ctx, out, tensors, dim)
    exchanged = rejoined_rows(ctx, tensors, dim) or rejoined_pieces(ctx, tensors, dim)
    if exchanged is not None:
        return exchanged
    ungathered = _ungathered(ctx, tensors, dim)
    if ungathered is not None:
        return ungathered
    rejoined = _rejoined_cut(ctx, tensors, dim, pl)
    return tuple(rejoined.get(a) or _joined_sections(ctx, tensors, a, dim)
                 if isinstance(p, Shard) and norm_dim(p.dim, ndim) == dim and not _gathered_inside(ctx, tensors, a, dim)
                 else p for a, p in enumerate(pl))


def _gathered_inside(ctx: RuleContext, tensors, a: int, dim: int) -> bool:
    """Whether ``tensors`` are the pieces of a list all-gather along ``dim`` over axes inside
    (faster than) axis ``a``, joined in order: a's shard of that dim is whole again, as when
    a tensor all-gather's blocks are joined (see _ungathered)."""
    pls = [ctx.types(t) for t in tensors]
    gathered = [b for b, p in enumerate(pls[0]) if type(p) is GatheredPiece and norm_dim(p.dim, tensors[0].dim()) == dim]
    return (bool(gathered) and len(tensors) == prod(ctx.sizes[b] for b in gathered)
            and all(type(pl[b]) is GatheredPiece for pl in pls[1:] for b in gathered)
            and max(axis_stride(ctx, b) for b in gathered) < axis_stride(ctx, a))


def _rejoined_cut(ctx: RuleContext, tensors, dim: int, pl: Pl) -> dict[int, Placement]:
    """Axes on which cat joins, in order, what was made from the pieces of a shard cut by
    position along ``dim`` (see :mod:`position_cuts`): there the result is the source's shard."""
    cut_axes = [a for a, p in enumerate(pl) if isinstance(p, Shard) and norm_dim(p.dim, tensors[0].dim()) == dim
                and all(type((ctx.types(t) or pl)[a]) is Shard for t in tensors)]
    if not cut_axes:
        return {}
    source = ctx.cuts.backward_join() or ctx.cuts.forward_join(tensors)
    if source is None:
        return {}
    return {a: source[a] for a in cut_axes if type(source[a]) is Shard}


def _ungathered(ctx: RuleContext, tensors, dim: int) -> Pl | None:
    """The dim-0 chunks of gathered blocks (all-gathered from S(dim) on some axes) joined
    along ``dim`` again, in order: the gathered axes are R, and the others keep the gathered
    tensor's placement. A shard of ``dim`` on an axis outside (slower than) the gathered ones
    is whole again; on an axis inside them its pieces are sections (see _joined_sections)."""
    base = tensors[0]._base
    pl = ctx.types(base) if base is not None else None
    if (pl is None or any(t._base is not base for t in tensors) or chunk_dim(tensors) != 0
            or tensors[0].storage_offset() != base.storage_offset()):
        return None
    gathered = [a for a, p in enumerate(pl) if isinstance(p, Gathered)]
    if not gathered or any(norm_dim(pl[a].dim, base.dim()) != dim for a in gathered):
        return None
    if len(tensors) != prod(ctx.sizes[a] for a in gathered):
        return None
    inner = max(axis_stride(ctx, a) for a in gathered)
    if any(isinstance(p, Shard) and norm_dim(p.dim, base.dim()) == dim and ctx.sizes[a] > 1
           and axis_stride(ctx, a) < inner for a, p in enumerate(pl) if a not in gathered):
        return None  # a shard of an axis inside the gathered ones: its pieces are sections
    return tuple(R if a in gathered else p for a, p in enumerate(pl))


def _joined_sections(ctx: RuleContext, tensors, a: int, dim: int) -> Placement:
    """cat along a dim the pieces are cut along on axis ``a``: every rank holds its part of
    each piece, in order, so the result is a fused dim with the pieces as its sections (GLU's
    backward joins the gradients of its two halves so); routed rows of one route join their
    parts (see :mod:`routed`), and constant rows after them pad them. A piece cut otherwise
    does not line up with the others: V."""
    if any(type(ctx.types(t)[a]) is Routed for t in tensors):
        return _joined_routes(ctx, tensors, a, dim)
    sections: list[int] = []
    outside = set()
    for t in tensors:
        if t.shape[dim] == 0:
            continue
        p = ctx.types(t)[a]
        if type(p) not in (Shard, SectionShard, RankChunk) or norm_dim(p.dim, t.dim()) != dim:
            return V
        sections += p.sections if type(p) is SectionShard else [t.shape[dim]]
        outside.add(p.outside)
    if len(outside) > 1:
        return V
    return SectionShard(dim, tuple(sections), *outside) if len(sections) > 1 else S(dim, *outside)


def _joined_routes(ctx: RuleContext, tensors, a: int, dim: int) -> Placement:
    """Routed rows of one route joined in order, then any constant rows (zeros or not): the
    route's rows followed by that many padding rows (see :class:`types.Routed`)."""
    tensors = [t for t in tensors if t.shape[dim] or type(ctx.types(t)[a]) is Routed]
    pieces = [ctx.types(t)[a] for t in tensors]
    count = next((k for k, p in enumerate(pieces) if type(p) is not Routed), len(pieces))
    routed, padding = pieces[:count], tensors[count:]
    if not all(norm_dim(p.dim, tensors[0].dim()) == dim for p in routed) or not all(
            ctx.const(t) and replicated(p) for t, p in zip(padding, pieces[count:], strict=True)):
        return V
    rows = joined(routed, dim) if routed else None
    if rows is None or not padding:
        return rows or V
    return rows.padded(sum(t.shape[dim] for t in padding), all(ctx.zero(t) for t in padding))


def _stack_rule(ctx: RuleContext, args, kwargs, out):
    ndim = out.dim()
    dim = norm_dim(arg(args, kwargs, 1, "dim", 0), ndim)
    pl = elementwise(ctx, _pieces(ctx, args[0]))
    if pl is None:
        return None
    return shift_shards(pl, lambda d: d + (d >= dim))


def _cut_by_two_axes(pl: Pl, pairs: tuple[tuple[int, int], ...]) -> dict[int, None]:
    """The piece is this rank's chunk by its rank in a group over two replicated (or untyped)
    axes (Megatron's tp x ep expert group, dp x cp; ``pairs``: see :func:`_chunk_axes`): a cut
    the per-axis types cannot say, so both axes become unknown rather than stay replicated. A
    piece of a split into another number of parts than the group has ranks is not (GDN's
    sections [16, 16, 32] at cp2-dp2, whose first is rank 0's quarter by chance)."""
    for a, b in pairs:
        if (pl[a] is None or replicated(pl[a])) and (pl[b] is None or replicated(pl[b])):
            return {a: None, b: None}
    return {}


def _as_strided_rule(ctx: RuleContext, args, kwargs, out):
    """as_strided: any view of the input's storage. One that reproduces the input's layout
    keeps its type (autograd does that), one that reads it all in order is a reshape (autograd's
    backward of an in-place op on a view of a flat buffer); any other picks the same elements
    on every rank, so a value whole on an axis, partial or varying there keeps that placement
    (a gathered one is plain R: its blocks are cut), while a shard's meaning is lost."""
    x = args[0]
    pl = ctx.types(x)
    if pl is None or (out.shape == x.shape and out.stride() == x.stride()):
        return pl
    if same_elements(x, out):  # all of a contiguous input, read in order: a reshape
        return _view_rule(ctx, args, kwargs, out)
    return tuple(None if isinstance(p, Shard) else R if isinstance(p, Gathered) else p for p in pl)


def same_elements(a, b) -> bool:
    """Whether ``a`` and ``b`` are contiguous views of the same elements in the same order."""
    return (a.storage_offset() == b.storage_offset() and a.numel() == b.numel()
            and a.is_contiguous() and b.is_contiguous())


def _copy_rule(ctx: RuleContext, args, kwargs, out):
    """The source's type; a replicated source broadcast along a dim the destination shards
    fills the destination's shard of the broadcast value (as ``dst + src`` would)."""
    dst, src = args[0], args[1]
    pl = ctx.types(src)
    if pl is None:
        return None
    lead = dst.dim() - src.dim()
    pl = shift_shards(pl, lambda d: norm_dim(d, src.dim()) + lead)
    old = ctx.types(dst)
    if old is None or tuple(src.shape) == tuple(dst.shape):
        return pl
    return tuple(o if replicated(p) and isinstance(o, Shard) and _broadcast_along(src, dst, o.dim) else p
                 for p, o in zip(pl, old, strict=True))


def _broadcast_along(src: torch.Tensor, dst: torch.Tensor, dim: int) -> bool:
    """Whether ``src``, broadcast to ``dst``'s shape, repeats itself along ``dst``'s ``dim``."""
    d = norm_dim(dim, dst.dim()) - (dst.dim() - src.dim())
    return d < 0 or (src.shape[d] == 1 and dst.shape[norm_dim(dim, dst.dim())] > 1)


def _fill_rule(ctx: RuleContext, args, kwargs, out):
    value = args[1]
    if is_tensor(value):
        return ctx.types(value)
    return (R,) * ctx.n


def _flip_like(dims_pos: int) -> Callable:
    """flip/roll/repeat: reordering or repeating a sharded dim loses its meaning (V)."""
    @on_typed_operand
    def rule(ctx: RuleContext, x, pl, args, kwargs, out):
        dims = arg(args, kwargs, dims_pos, "dims", None)
        touched = reduced_dims(dims, x.dim())
        return tuple(V if isinstance(p, Shard) and norm_dim(p.dim, x.dim()) in touched else p
                     for p in pl)
    return rule


@on_typed_operand
def _repeat_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    reps = list(args[1])
    lead = len(reps) - x.dim()
    result = []
    for p in pl:
        if isinstance(p, Shard):
            d = norm_dim(p.dim, x.dim()) + lead
            result.append(V if reps[d] != 1 else S(d, p.outside))
        else:
            result.append(None if isinstance(p, Gathered) else p)
    return tuple(result)


def _constant_pad_rule(ctx: RuleContext, args, kwargs, out):
    """Constant padding is local: S(d) stays S(d) if d is not padded (padding a sharded dim
    pads every rank's piece, V); R and V stay; P stays P only when padding with zeros."""
    x, pad = args[0], list(args[1])
    pl = ctx.types(x)
    if pl is None:
        return None
    value = arg(args, kwargs, 2, "value", 0)
    padded = {x.dim() - 1 - i // 2 for i, amount in enumerate(pad) if amount}
    result = []
    for p in pl:
        if isinstance(p, Shard) and not isinstance(p, BlockShard | RankChunk):
            d = norm_dim(p.dim, x.dim())
            result.append(V if d in padded else moved(p, d))
        elif is_partial(p):
            result.append(p if value == 0 or not padded else V)
        else:
            result.append(p if replicated(p) or p is V else None)
    return tuple(result)


RULES: dict[str, Callable] = {
    "view": _view_rule, "_unsafe_view": _view_rule, "reshape": _view_rule,
    "_reshape_alias": _view_rule,
    "permute": _permute_rule, "transpose": _transpose_rule, "t": _transpose_rule,
    "unsqueeze": _unsqueeze_rule, "squeeze": _squeeze_rule, "expand": _expand_rule,
    "slice": _slice_rule, "select": _select_rule, "split": _split_rule,
    "split_with_sizes": _split_rule, "unbind": _unbind_rule,
    "cat": _cat_rule, "stack": _stack_rule,
    "flip": _flip_like(1), "roll": _flip_like(2), "repeat": _repeat_rule,
    "as_strided": _as_strided_rule, "fill": _fill_rule, "copy": _copy_rule,
    "constant_pad_nd": _constant_pad_rule,
}
"""Shape-op rules per op base name."""
