"""Typing rules for the c10d collectives that torch.distributed routes through the dispatcher.

``dist.all_reduce`` & co. reach a TorchDispatchMode as ``c10d::*_`` ops carrying the
ProcessGroup as a ScriptObject; ``torch.distributed._functional_collectives`` reaches it as
``_c10d_functional::*`` ops carrying a group name. Both are typed here, per mesh axis the
group acts on; a group that matches no combination of mesh axes is an "unknown axis".
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.exchange import (
    columns_inside,
    copy_mark,
    even_splits,
    mark_exchanged,
    mark_exchanged_pieces,
)
from shardcheck.typecheck.rules.common import (
    NO_TENSOR,
    RuleContext,
    as_pieces,
    axis_stride,
    chunk_dim,
    inside,
    is_partial,
    is_sum,
    mark_gathered_rows,
    nested_outside,
    stacks_as_pieces,
)
from shardcheck.typecheck.rules.routing import routed_types
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
    S,
    SectionShard,
    Shard,
    V,
)
from shardcheck.typecheck.violations import Violation

SUM, AVG, PRODUCT, MIN, MAX = "sum", "avg", "product", "min", "max"
_C10D_OPS = {0: SUM, 1: AVG, 2: PRODUCT, 3: MIN, 4: MAX}  # c10d::ReduceOp::RedOpType


def _reduce_op(obj: Any) -> str:
    if isinstance(obj, str):
        return obj.lower()
    return _C10D_OPS.get(obj._get_method("op")(), "other")  # obj.op() costs 2.5x as much


def process_group(group: Any) -> dist.ProcessGroup:
    """The ProcessGroup given as a ScriptObject, a ProcessGroup or a name."""
    if type(group) is torch.ScriptObject:  # as a c10d op carries it (isinstance of ProcessGroup
        return dist.ProcessGroup.unbox(group)  # runs its metaclass' Python __instancecheck__)
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)


# by id(ProcessGroup): (a weak reference to it, its ranks), dropped when it dies (a group's
# ranks never change; a look-up by id makes no weak reference, as a WeakKeyDictionary's does)
_GROUP_RANKS: dict[int, tuple[weakref.ref, tuple[int, ...]]] = {}


def group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of a ProcessGroup given as a ScriptObject, a ProcessGroup or a name."""
    pg = process_group(group)
    key = id(pg)
    known = _GROUP_RANKS.get(key)
    if known is None or known[0]() is not pg:
        ref = weakref.ref(pg, functools.partial(_group_died, key))
        known = _GROUP_RANKS[key] = (ref, tuple(dist.get_process_group_ranks(pg)))
    return known[1]


def _group_died(key: int, _ref: weakref.ref) -> None:
    _GROUP_RANKS.pop(key, None)


class UnknownAxis(Violation):
    """A collective's group is no axis (or combination of axes) of the mesh."""

    def __init__(self, ranks: tuple[int, ...], mesh) -> None:
        axes = ", ".join(f"{a.name}={list(a.ranks)}" for a in mesh.axes.values())
        super().__init__("unknown axis", -1, f"the group has ranks {list(ranks)}; the mesh has {axes}")


_UNSEEN = object()
# by (a group's ranks, id of the mesh key: interned, kept for good, and holding every axis'
# name and ranks, and this rank): the axes a collective over the group acts on, None for none
_AXES: dict[tuple[tuple[int, ...], int], tuple[int, ...] | None] = {}


def _axes(ctx: RuleContext, group: Any) -> list[int]:
    """The mesh axes (by index) a collective over ``group`` acts on."""
    ranks = group_ranks(group)
    key = (ranks, id(ctx.key))
    axes = _AXES.get(key, _UNSEEN)
    if axes is _UNSEEN:
        names = ctx.mesh.axes_of(ranks)
        axes = _AXES[key] = None if names is None else tuple(map(ctx.names.index, names))
    if axes is None:
        raise UnknownAxis(ranks, ctx.mesh)
    return list(axes)


def _on_axes(pl: Pl, axes: list[int], step: Callable[[Placement, int], Placement | None]) -> Pl:
    out = list(pl)
    for a in axes:
        p = pl[a]
        out[a] = None if p is None else step(p, a)
    return tuple(out)


# --- per-axis steps ------------------------------------------------------------------------

def _all_reduce_step(op: str) -> Callable[[Placement, int], Placement | None]:
    def step(p: Placement, a: int) -> Placement | None:
        if isinstance(p, Gathered):
            return None
        if op == SUM:
            if p is R or p is I:
                raise Violation("double count", a)
            if p is PAVG:
                raise Violation("mean over shard", a)
            return R if is_sum(p) or p is V else V
        if op == AVG:
            if is_sum(p):  # every rank holds the sum over n: a partial sum of equal shares
                return PEVEN
            return R if p in (PAVG, V, R, I) else V
        if is_partial(p):
            raise Violation("mean over shard" if p is PAVG else "non-linear on partial", a)
        if op == PRODUCT and p in (R, I):
            raise Violation("double count", a, "a PRODUCT reduction of a replicated value raises "
                                               "it to the power of the axis size")
        return R if p in (R, I, V) else V
    return step


def _gather_step(into_tensor: bool, source: torch.Tensor) -> Callable[[Placement, int], Placement | None]:
    def step(p: Placement, a: int) -> Placement | None:
        if p is R or p is I:
            raise Violation("gather of replicated", a)
        if type(p) is SectionShard:  # in rank order: each rank's part of every section in turn
            return V if into_tensor else None
        if stacks_as_pieces(p, source):
            return R
        if isinstance(p, BlockShard):
            return None
        if isinstance(p, Shard) and into_tensor:
            return Gathered(p.dim) if p.dim != 0 else R
        if isinstance(p, Shard):
            return GatheredPiece(p.dim)
        return R if p is V else None
    return step


def _scatter_step(op: str, dim: int = 0, nested: bool = False) -> Callable[[Placement, int], Placement | None]:
    """reduce-scatter: the reduced value's chunk along ``dim``; V when ``nested`` (see
    :func:`_reduce_scatter_of`)."""
    chunk = V if nested else S(dim)

    def step(p: Placement, a: int) -> Placement | None:
        if op == SUM:
            if p is R or p is I:
                raise Violation("scatter of replicated", a)
            if p is PAVG:
                raise Violation("mean over shard", a)
            return chunk if is_sum(p) or p is V else None
        if op == AVG:
            if is_sum(p):  # a chunk of the sum over n: neither a shard nor a partial sum
                raise Violation("mean of partial", a)
            return chunk if p in (R, I, V, PAVG) else None
        return None
    return step


def _holding_axes(ctx: RuleContext, pl: Pl, axes: list[int], dim: int, ndim: int) -> list[int]:
    """The axes outside the group, inside it (faster) by the mesh order, that shard ``dim``:
    a reduce-scatter over ``axes`` along ``dim`` cuts inside their pieces (rows cp shards,
    scattered over tp by sequence parallelism where the ranks number cp fastest)."""
    if not axes:
        return []
    outer = min(axis_stride(ctx, a) for a in axes)
    return [b for b, p in enumerate(pl)
            if b not in axes and ctx.sizes[b] > 1 and isinstance(p, Shard)
            and p.dim % max(ndim, 1) == dim % max(ndim, 1) and axis_stride(ctx, b) < outer]


def _reduce_scatter_of(ctx: RuleContext, pl: Pl, axes: list[int], op: str, dim: int, ndim: int) -> tuple[Pl, Callable]:
    """The input's types as the output keeps them off the group, and the group's step. An axis
    whose pieces the group's chunks sit inside, against the mesh order, holds them: its shard
    ``outside`` (see :class:`Shard`). With more than one such axis, a group of several axes or
    a shard of another kind, that nesting has no placement: V on the group."""
    holding = _holding_axes(ctx, pl, axes, dim, ndim)
    if not holding:
        return pl, _scatter_step(op, dim)
    b = holding[0]
    if len(holding) > 1 or len(axes) != 1 or type(pl[b]) is not Shard or nested_outside(pl, b, ndim):
        return pl, _scatter_step(op, dim, nested=True)
    return pl[:b] + (S(pl[b].dim, True),) + pl[b + 1:], _scatter_step(op, dim)


def _broadcast_step(p: Placement, a: int) -> Placement | None:
    """One rank's value everywhere: R, unless it was one rank's part of a sum (lost) or its
    shard (a value of its own, V)."""
    if is_partial(p):
        raise Violation("broadcast of partial", a)
    return V if isinstance(p, Shard | Gathered) else R


def _reduce_step(op: str) -> Callable[[Placement, int], Placement | None]:
    """reduce to one rank: the reduction's rules, and a value only the root holds (V)."""
    reduced = _all_reduce_step(op)

    def step(p: Placement, a: int) -> Placement | None:
        reduced(p, a)
        return V
    return step


def _to_varying(p: Placement, a: int) -> Placement:
    return V


# --- c10d ops (torch.distributed's in-place API) --------------------------------------------

def _typed_update(ctx: RuleContext, tensors, source_pl: Pl | None, axes, step) -> Any:
    """Set every tensor in ``tensors`` (in place) to ``source_pl`` transformed on ``axes``.

    An untyped tensor becomes unknown; its typed views (``param.main_grad`` in a flat
    gradient buffer) are transformed on ``axes`` when ``step`` is given, else forgotten.
    """
    if source_pl is None:
        views = (lambda old: _on_axes(old, axes, step)) if step is not None else None
        for t in tensors:
            ctx.update_inplace(t, None, views)
        return None
    new = _on_axes(source_pl, axes, step)
    for t in tensors:
        ctx.update_inplace(t, new, lambda old: _on_axes(old, axes, step))
    return NO_TENSOR


def _allreduce(ctx: RuleContext, args, kwargs, out):
    tensors, group, op = args[0], args[1], _reduce_op(args[2])
    pls = [ctx.types(t) for t in tensors]
    if any(pl is None for pl in pls):
        return _buffer_update(ctx, tensors, group, _all_reduce_step(op))
    axes = _axes(ctx, group)
    for t, pl in zip(tensors, pls, strict=True):
        step = _of_contributions(ctx, [t], pl, axes, op, _all_reduce_step(op), torch.ops.c10d.allreduce_.default,
                                 all_reduce=True)
        _typed_update(ctx, [t], pl, axes, step)
    return NO_TENSOR


def _contributions(ctx: RuleContext, tensors) -> bool:
    """Whether ``tensors`` are replicated zeros, or zeros one value was added into (ACC)."""
    return all(ctx.zero(t) or ctx.accumulated(t) for t in tensors)


def _of_contributions(ctx: RuleContext, sources: list, pl: Pl, axes: list[int], op: str, step, func,
                      all_reduce: bool = False) -> Callable:
    """``step`` of a reduction (all-reduce or reduce-scatter, any form) of ``sources``, for
    replicated zeros or zeros one value was added into: zeros sum to zeros, and a value added
    on some ranks only is their contribution (Megatron adds the loss on the last pipeline
    stage only), a sum over the axis. Added on every rank it is a double count: each rank
    reports it, and the report stands when ranks at two coordinates make it. Averaged by an
    all-reduce, zeros or a value added in a branch on the rank are the value over n on every
    rank: a partial sum of equal shares."""
    summed = op == SUM and _contributions(ctx, sources)
    averaged = all_reduce and op == AVG and all(ctx.zero(t) or ctx.added_on_some_ranks(t) for t in sources)
    if not (summed or averaged):
        return step
    for a in axes if summed else ():
        if pl[a] is R or pl[a] is I:
            occurrence = ctx.count_varying_cut()  # on every rank, zeros or not: numbered alike
            if ctx.accumulated(sources[0]):
                ctx.report(Violation("double count", a, "zeros this rank added a replicated value "
                                     "into: a double count if every rank added it", occurrence,
                                     unconfirmed=True), func, (sources[0],))
    return lambda p, a: step(P if p is R or p is I else p, a)


def _buffer_update(ctx: RuleContext, tensors, group, step) -> Any:
    """A collective on buffers without a type of their own (a flat gradient buffer holding
    parameters of different layouts): each typed view of them takes the collective's step."""
    try:
        axes = _axes(ctx, group)
    except UnknownAxis:
        return _typed_update(ctx, tensors, None, (), None)
    return _typed_update(ctx, tensors, None, axes, step)


def _allgather(ctx: RuleContext, args, kwargs, out):
    outputs, inputs, group = args[0], args[1], args[2]
    flat = [t for row in outputs for t in row]
    pl = ctx.types(inputs[0])
    if pl is None:
        return _typed_update(ctx, flat, None, (), None)
    return _typed_update(ctx, flat, pl, _axes(ctx, group), _gather_step(False, inputs[0]))


def _allgather_base(ctx: RuleContext, args, kwargs, out):
    output, inp, group = args[0], args[1], args[2]
    pl = ctx.types(inp)
    if pl is None:
        return _typed_update(ctx, [output], None, (), None)
    axes = _axes(ctx, group)
    mark_gathered_rows(ctx, output, pl, axes, len(group_ranks(group)))
    return _typed_update(ctx, [output], _inner_rows_as_sections(ctx, pl, axes, inp), axes,
                         _gather_step_over(pl, axes, inp))


def _gather_step_over(pl: Pl, axes: list[int], source: torch.Tensor) -> Callable:
    """The tensor all-gather's step, V on every axis of a group over axes that shard different
    dims: the blocks it stacks, in the group's rank order, are a grid of them that no
    placement per axis says."""
    dims = {p.dim % max(source.dim(), 1) for p in (pl[a] for a in axes) if isinstance(p, Shard)}
    return _to_varying if len(dims) > 1 else _gather_step(True, source)


def _inner_rows_as_sections(ctx: RuleContext, pl: Pl, axes: list[int], inp: torch.Tensor) -> Pl:
    """Gathering dim-0 shards over ``axes``: an axis whose pieces sit inside the group's (see
    :func:`~shardcheck.typecheck.rules.common.inside`) and that shards dim 0 too now holds its piece
    of each gathered block, in order: sections of dim 0; one whose pieces held the group's
    holds its piece whole. An axis outside the group whose blocks were stacked on dim 0
    already (gathered blocks) has them interleaved with the group's now, in no order a
    placement says: V."""
    pl = tuple(V if a not in axes and isinstance(p, Gathered) else p for a, p in enumerate(pl))
    if not any(isinstance(pl[a], Shard) and pl[a].dim % max(inp.dim(), 1) == 0 for a in axes):
        return pl
    count = 1
    for a in axes:
        count *= ctx.sizes[a]
    return tuple(_rows_around_gathered(ctx, pl, b, axes, inp.shape[0], count)
                 if b not in axes and type(p) is Shard and p.dim % max(inp.dim(), 1) == 0
                 and ctx.sizes[b] > 1 else p for b, p in enumerate(pl))


def _rows_around_gathered(ctx: RuleContext, pl: Pl, b: int, axes: list[int], rows: int, count: int) -> Shard:
    """Axis ``b``'s dim-0 shard once the group's pieces of dim 0 are gathered: sections (its
    piece of each block) where its pieces sat inside the group's, else its piece, whole. With
    a group of several axes the mesh order decides."""
    if len(axes) == 1:
        held = inside(ctx, pl, b, axes[0])
    else:
        held = axis_stride(ctx, b) < min(axis_stride(ctx, a) for a in axes)
    return SectionShard(0, (rows,) * count) if held else S(pl[b].dim)


def _functional_gather(ctx: RuleContext, args, kwargs, out):
    pl = ctx.types(args[0])
    if pl is None:
        return None
    axes = _axes(ctx, args[2])
    mark_gathered_rows(ctx, out, pl, axes, args[1])
    return _on_axes(_inner_rows_as_sections(ctx, pl, axes, args[0]), axes, _gather_step_over(pl, axes, args[0]))


def _reduce_scatter(ctx: RuleContext, args, kwargs, out):
    outputs, inputs, group, op = args[0], args[1], args[2], _reduce_op(args[3])
    dim = chunk_dim(inputs[0]) if len(inputs) == 1 else None
    pieces = [ctx.types(t) for row in inputs for t in row]
    pieces = [None if p is None else as_pieces(p) for p in pieces]
    pl = pieces[0] if pieces and all(p == pieces[0] for p in pieces) else None
    if pl is None or dim is None or not all(_row_major(t) for row in inputs for t in row):
        return _typed_update(ctx, outputs, None, (), None)
    axes = _axes(ctx, group)
    kept, step = _reduce_scatter_of(ctx, pl, axes, op, dim, inputs[0][0].dim())
    step = _of_contributions(ctx, inputs[0], pl, axes, op, step, torch.ops.c10d.reduce_scatter_.default)
    return _typed_update(ctx, outputs, kept, axes, step)


def _row_major(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements lie in memory in its own order (gaps allowed, as in a column
    chunk). Gloo's list reduce-scatter reduces a piece laid out otherwise (a chunk of a
    transposed tensor) in another order than its elements', with no error: unknown."""
    strides = [st for size, st in zip(t.shape, t.stride(), strict=True) if size > 1]
    return all(a >= b for a, b in zip(strides, strides[1:], strict=False))


def _reduce_scatter_base(ctx: RuleContext, args, kwargs, out):
    output, inp, group, op = args[0], args[1], args[2], _reduce_op(args[3])
    pl = ctx.types(inp)
    if pl is None:
        return _typed_update(ctx, [output], None, (), None)
    axes = _axes(ctx, group)
    kept, step = _reduce_scatter_of(ctx, pl, axes, op, _stacked_dim(ctx, inp, group), inp.dim())
    kept = _sections_scattered(ctx, kept, axes, group, output.shape[0] if output.dim() else 0)
    step = _of_contributions(ctx, [inp], pl, axes, op, step, torch.ops.c10d._reduce_scatter_base_.default)
    return _typed_update(ctx, [output], kept, axes, step)


def _sections_scattered(ctx: RuleContext, pl: Pl, axes: list[int], group, rows: int) -> Pl:
    """A reduce-scatter keeps this rank's ``rows`` of dim 0: an axis outside the group whose
    pieces are sections of dim 0 (blocks stacked there, see mark_stacked) keeps the section
    this rank's chunk is (S(0)), or nothing that lines up (V)."""
    if not any(type(pl[b]) is SectionShard and pl[b].dim == 0 for b in range(len(pl)) if b not in axes):
        return pl
    start = group_ranks(group).index(ctx.mesh.rank) * rows
    return tuple(p if a in axes or type(p) is not SectionShard or p.dim != 0 else p.piece(start, rows) or V
                 for a, p in enumerate(pl))


def _stacked_dim(ctx: RuleContext, inp: torch.Tensor, group) -> int:
    """The dim the blocks of ``inp``'s dim 0 were cut from (see :func:`mark_stacked`), else 0."""
    mark = _stacked_mark(ctx, inp, group)
    return 0 if mark is None else mark[1]


def _stacked_mark(ctx: RuleContext, inp: torch.Tensor, group) -> tuple | None:
    """``inp``'s :func:`mark_stacked` mark for a collective over ``group``, else None; a view
    of the whole stacked tensor as it is (the backward of a reshape) has it."""
    mark = tensor_state.read(inp, "stacked")
    base = inp._base
    if (mark is None and base is not None and base.shape == inp.shape and inp.is_contiguous()
            and base.is_contiguous() and base.storage_offset() == inp.storage_offset()):
        mark = tensor_state.read(base, "stacked")
    if mark is None or mark[0] is not ctx.key or mark[2] != len(group_ranks(group)):
        return None
    return mark


def _alltoall_base(ctx: RuleContext, args, kwargs, out):
    output, inp, group = args[0], args[1], args[2]
    pl = ctx.types(inp)
    routed = routed_types(ctx, output, inp, pl, process_group(group), group_ranks(group),
                          _axes(ctx, group), args[3], args[4])
    if routed is not None:
        tensor_state.write(output, "exchanged", None)
        return _typed_update(ctx, [output], routed, (), None)
    if pl is None:
        tensor_state.write(output, "exchanged", None)
        return _typed_update(ctx, [output], None, (), None)
    return _typed_update(ctx, [output], *_exchange(ctx, output, inp, pl, group, args[3], args[4]))


def _exchange(ctx: RuleContext, output: torch.Tensor, inp: torch.Tensor, pl: Pl, group, output_splits, input_splits) -> tuple:
    """The input's types as the output keeps them, the axes and the step of an all-to-all
    (``output`` marked, see :mod:`exchange`). Uneven splits move blocks that line up with no
    shard: V."""
    axes = _axes(ctx, group)
    count = len(group_ranks(group))
    even = inp.dim() > 0 and even_splits(output_splits, input_splits, inp.shape[0], count)
    mark_exchanged(ctx, output, pl, axes, inp, even)
    mark = _stacked_mark(ctx, inp, group) if even and len(axes) == 1 else None
    if mark is None:
        return pl, axes, _exchange_step(0)
    pl, sections = columns_inside(ctx, pl, mark[3], axes[0], mark[1], inp.dim())
    return pl, axes, _exchange_step(mark[1], sections)


def _exchange_step(stacked: int, sections: tuple | None = None) -> Callable[[Placement, int], Placement | None]:
    """all-to-all of dim-0 blocks: rank k gets block k of every rank. Blocks stacked from the
    chunks of a dim ``stacked`` of a sequence shard (Megatron's sp2hp) give the shard of that
    dim (in ``sections`` where each chunk holds a piece of each, see
    :func:`~shardcheck.typecheck.exchange.columns_inside`); anything else is a value of each
    rank's own (V; the blocks of a shard of another dim are S(0) once joined along that dim
    again, see :mod:`exchange`)."""
    def step(p: Placement, a: int) -> Placement | None:
        if stacked and isinstance(p, Shard) and p.dim == 0:
            return SectionShard(stacked, sections) if sections else S(stacked)
        return V
    return step


def _alltoall(ctx: RuleContext, args, kwargs, out):
    outputs, inputs, group = args[0], args[1], args[2]
    pls = [ctx.types(t) for t in inputs]
    pl = as_pieces(pls[0]) if pls and all(p is not None for p in pls) else None
    if pl is None:
        mark_exchanged_pieces(ctx, outputs, inputs, (), [])
        return _typed_update(ctx, outputs, None, (), None)
    axes = _axes(ctx, group)
    mark_exchanged_pieces(ctx, outputs, inputs, pl, axes)
    return _typed_update(ctx, outputs, pl, axes, _to_varying)


def _broadcast(ctx: RuleContext, args, kwargs, out):
    tensors, group, root = args[0], args[1], args[2]
    pls = _root_types(ctx, tensors, group, root)
    if any(pl is None for pl in pls):
        return _typed_update(ctx, tensors, None, (), None)
    axes = _axes(ctx, group)
    for t, pl in zip(tensors, pls, strict=True):
        _typed_update(ctx, [t], pl, axes, _broadcast_step)
    return NO_TENSOR


def _root_types(ctx: RuleContext, tensors, group, root: int) -> list[Pl | None]:
    """The types of the tensors the root (a rank of ``group``) sends: what every rank holds
    after the broadcast, on the other axes too. A rank that did not compute the value (a
    pipeline stage's placeholder zeros for the last stage's token count) cannot know them, so
    the root tells them (not on a fake group, whose ranks cannot talk)."""
    own = [ctx.types(t) for t in tensors]
    pg = process_group(group)
    if dist.get_backend(pg) == "fake":
        return own
    sent = [own]
    dist.broadcast_object_list(sent, group_src=root, group=pg)
    return sent[0]


def _functional_broadcast(ctx: RuleContext, args, kwargs, out):
    (pl,) = _root_types(ctx, [args[0]], args[2], args[1])
    return None if pl is None else _on_axes(pl, _axes(ctx, args[2]), _broadcast_step)


def _reduce(ctx: RuleContext, args, kwargs, out):
    tensors, group, op = args[0], args[1], _reduce_op(args[2])
    pls = [ctx.types(t) for t in tensors]
    if any(pl is None for pl in pls):
        return _buffer_update(ctx, tensors, group, lambda p, a: V)
    axes = _axes(ctx, group)
    for t, pl in zip(tensors, pls, strict=True):
        _typed_update(ctx, [t], pl, axes, _reduce_step(op))
    return NO_TENSOR


def _to_root_or_from_root(ctx: RuleContext, args, kwargs, out):
    """scatter and gather: what a rank receives is one rank's value, V on the group's axes;
    on the other axes it is what the root held, which the ranks without the list cannot see:
    V there too (the receiving buffer's own type says nothing of it)."""
    for t in _flat_tensors(args[0]):
        ctx.update_inplace(t, (V,) * ctx.n)
    return NO_TENSOR


def _flat_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _flat_tensors(item)]


def _point_to_point_receive(ctx: RuleContext, args, kwargs, out):
    """recv: the buffer now holds another rank's value."""
    for t in args[0]:
        ctx.update_inplace(t, (V,) * ctx.n)
    return NO_TENSOR


def _no_data_change(ctx: RuleContext, args, kwargs, out):
    """send, barrier: nothing this rank holds changes."""
    return NO_TENSOR


# --- functional collectives (out of place, group by name) -----------------------------------

def _functional_all_to_all(ctx: RuleContext, args, kwargs, out):
    """all_to_all_single(input, output_split_sizes, input_split_sizes, group), told where its
    input's dim-0 blocks came from."""
    pl = ctx.types(args[0])
    if pl is None:
        return None
    return _on_axes(*_exchange(ctx, out, args[0], pl, args[3], args[1], args[2]))


def _functional_reduce_scatter(ctx: RuleContext, args, kwargs, out):
    """reduce_scatter_tensor(input, op, group_size, group), told where the input's dim-0
    blocks came from."""
    pl = ctx.types(args[0])
    if pl is None:
        return None
    group = args[3]
    axes = _axes(ctx, group)
    op = _reduce_op(args[1])
    kept, step = _reduce_scatter_of(ctx, pl, axes, op, _stacked_dim(ctx, args[0], group), args[0].dim())
    step = _of_contributions(ctx, [args[0]], pl, axes, op, step, torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return _on_axes(_sections_scattered(ctx, kept, axes, group, out.shape[0] if out.dim() else 0), axes, step)


def _functional_all_reduce_step(ctx: RuleContext, args, pl: Pl) -> tuple[list[int], Callable]:
    """all_reduce(input, op, group): the group's axes and the step."""
    axes, op = _axes(ctx, args[2]), _reduce_op(args[1])
    return axes, _of_contributions(ctx, [args[0]], pl, axes, op, _all_reduce_step(op),
                                   torch.ops._c10d_functional.all_reduce.default, all_reduce=True)


def _functional_all_reduce(ctx: RuleContext, args, kwargs, out):
    pl = ctx.types(args[0])
    return None if pl is None else _on_axes(pl, *_functional_all_reduce_step(ctx, args, pl))


def _functional_all_reduce_(ctx: RuleContext, args, kwargs, out):
    pl = ctx.types(args[0])
    if pl is None:
        return _typed_update(ctx, [args[0]], None, (), None)
    return _typed_update(ctx, [args[0]], pl, *_functional_all_reduce_step(ctx, args, pl))


def _waited(ctx: RuleContext, args, kwargs, out):
    mark = tensor_state.read(args[0], "gathered")
    if mark is not None:
        tensor_state.write(out, "gathered", mark)
    copy_mark(args[0], out)
    return ctx.types(args[0])


def _same_type(ctx: RuleContext, args, kwargs, out):
    return ctx.types(args[0])


# by (namespace, op name): c10d ops and functional collectives
RULES: dict[tuple[str, str], Callable] = {
    ("c10d", "allreduce_"): _allreduce,
    ("c10d", "allreduce_coalesced_"): _allreduce,
    ("c10d", "allgather_"): _allgather,
    ("c10d", "_allgather_base_"): _allgather_base,
    ("c10d", "reduce_scatter_"): _reduce_scatter,
    ("c10d", "_reduce_scatter_base_"): _reduce_scatter_base,
    ("c10d", "alltoall_base_"): _alltoall_base,
    ("c10d", "alltoall_"): _alltoall,
    ("c10d", "broadcast_"): _broadcast,
    ("c10d", "reduce_"): _reduce,
    ("c10d", "scatter_"): _to_root_or_from_root,
    ("c10d", "gather_"): _to_root_or_from_root,
    ("c10d", "send"): _no_data_change,
    ("c10d", "barrier"): _no_data_change,
    ("c10d", "monitored_barrier_"): _no_data_change,
    ("c10d", "recv_"): _point_to_point_receive,
    ("c10d", "recv_any_source_"): _point_to_point_receive,
    ("_c10d_functional", "all_reduce"): _functional_all_reduce,
    ("_c10d_functional", "all_reduce_"): _functional_all_reduce_,
    ("_c10d_functional", "all_gather_into_tensor"): _functional_gather,
    ("_c10d_functional", "reduce_scatter_tensor"): _functional_reduce_scatter,
    ("_c10d_functional", "all_to_all_single"): _functional_all_to_all,
    ("_c10d_functional", "broadcast"): _functional_broadcast,
    ("_c10d_functional", "wait_tensor"): _waited,
    ("_c10d_functional", "_wrap_tensor_autograd"): _same_type,
}
