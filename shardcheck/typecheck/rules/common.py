"""What the rule families share: reading args, partial and replicated placements, shards
moved, marks a rule leaves on a tensor for a later op (a stacked, cut or gathered tensor)."""


from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.position_cuts import PositionCuts
from shardcheck.typecheck.types import (
    PAVG,
    PEVEN,
    BlockShard,
    Gathered,
    I,
    InterleavedShard,
    Mesh,
    P,
    Pl,
    Placement,
    R,
    RankChunk,
    Routed,
    S,
    SectionShard,
    Shard,
)
from shardcheck.typecheck.violations import Violation

aten = torch.ops.aten


def interleaves(index: torch.Tensor, sections: tuple[int, ...], count: int) -> bool:
    """Whether ``index`` picks, from a dim of ``sections``, chunk 0 of every section, then
    chunk 1, ..., each section cut into ``count`` chunks."""
    if index.dim() != 1 or index.numel() != sum(sections) or any(size % count for size in sections):
        return False
    starts = [sum(sections[:i]) for i in range(len(sections))]
    order = [start + k * (size // count) + j for k in range(count)
             for start, size in zip(starts, sections, strict=True) for j in range(size // count)]
    return torch.equal(index.cpu(), torch.tensor(order, dtype=index.dtype))


def outer_of(p: Shard) -> int:
    return p.outer if type(p) is BlockShard else 1


def moved(p: Shard, dim: int, outside: bool | None = None) -> Shard:
    """The same kind of shard on another dim (``outside`` as given, else as ``p``'s)."""
    outside = p.outside if outside is None else outside
    if type(p) is BlockShard:
        return BlockShard(dim, p.outer, outside)
    if type(p) is InterleavedShard:
        return InterleavedShard(dim, p.chunks, p.count, outside)
    if type(p) is RankChunk:
        return RankChunk(dim)
    if type(p) is Routed:
        return p.at(dim)
    return SectionShard(dim, p.sections, outside) if type(p) is SectionShard else S(dim, outside)


def nested_outside(pl: tuple, a: int, ndim: int) -> bool:
    """Whether axis ``a``'s shard holds, inside its pieces, those of another axis that shards
    the same dim, against the mesh order (see :class:`Shard`); alone on its dim it is plain."""
    p = pl[a]
    return (isinstance(p, Shard) and p.outside
            and any(b != a and isinstance(q, Shard) and norm_dim(q.dim, ndim) == norm_dim(p.dim, ndim)
                    for b, q in enumerate(pl)))


def inside(ctx: RuleContext, pl: tuple, b: int, a: int) -> bool:
    """Whether axis ``b``'s pieces of a dim that axis ``a`` shards too sit inside ``a``'s: by
    the mesh order (the faster axis inside), unless one of them is ``outside``."""
    if isinstance(pl[a], Shard) and pl[a].outside:
        return True
    if isinstance(pl[b], Shard) and pl[b].outside:
        return False
    return axis_stride(ctx, b) < axis_stride(ctx, a)


def as_pieces(pl: tuple) -> tuple:
    """Read rank chunks as the replicated pieces they are (for cat and list collectives)."""
    return tuple(R if isinstance(p, RankChunk) else p for p in pl)


def chunk_dim(pieces) -> int | None:
    """The dim along which ``pieces`` are consecutive equal chunks of one tensor, in order."""
    if len(pieces) < 2:
        return 0 if pieces else None
    first = pieces[0]
    storage = first.untyped_storage().data_ptr()
    if any(t.shape != first.shape or t.stride() != first.stride()
           or t.untyped_storage().data_ptr() != storage for t in pieces):
        return None
    step = pieces[1].storage_offset() - first.storage_offset()
    if step <= 0 or any(t.storage_offset() - first.storage_offset() != k * step for k, t in enumerate(pieces)):
        return None
    return next((d for d in range(first.dim()) if first.shape[d] * first.stride(d) == step), None)


def mark_stacked(ctx: RuleContext, out: torch.Tensor, tensors, dim: int) -> None:
    """cat along dim 0 of the consecutive chunks of one tensor along another dim (Megatron's
    split-the-last-dim-and-stack before a reduce-scatter or all-to-all): remember the dim, so
    the collective that takes the blocks apart knows where they came from, and the type of
    the tensor the chunks were cut from, where known (see :func:`mark_cut`)."""
    if dim == 0 and len(tensors) > 1:
        c = chunk_dim(tensors)
        if c not in (None, 0):
            tensor_state.write(out, "stacked", (ctx.key, c, len(tensors), _cut_source(ctx, tensors, c)))


def mark_cut(ctx: RuleContext, pieces, pl: tuple, dim: int, total: int) -> None:
    """Remember, on pieces cut along ``dim`` (of length ``total``) from a tensor typed ``pl``
    that some axis shards there, that tensor's type: their types say only V there."""
    keep = any(isinstance(p, Shard) and norm_dim(p.dim, pieces[0].dim()) == dim for p in pl)
    for t in pieces:
        if keep:
            tensor_state.write(t, "cut", (ctx.key, pl, dim, total))
        else:
            tensor_state.write(t, "cut", None)


def _cut_source(ctx: RuleContext, tensors, dim: int) -> tuple | None:
    """The type of the tensor that ``tensors`` (its consecutive chunks along ``dim``) are all of."""
    marks = [tensor_state.read(t, "cut") for t in tensors]
    first = marks[0]
    if first is None or first[0] is not ctx.key or first[2] != dim \
            or first[3] != sum(t.shape[dim] for t in tensors):
        return None
    return first[1] if all(m is not None and m[0] is first[0] and m[1] == first[1] and m[2:] == first[2:]
                           for m in marks) else None


def axis_stride(ctx: RuleContext, a: int) -> int:
    """How far apart in rank neighbours on mesh axis ``a`` are: an inner (faster) axis is nearer.
    Of two axes sharding one dim, the inner one's pieces sit inside the outer one's."""
    ranks = ctx.mesh.axes[ctx.names[a]].ranks
    return abs(ranks[1] - ranks[0]) if len(ranks) > 1 else 0


def mark_gathered_rows(ctx: RuleContext, out: torch.Tensor, pl: tuple, axes: list[int], count: int) -> None:
    """A tensor all-gather of a dim-0 shard: remember that dim 0 of ``out`` stacks the
    ranks' rows, so putting its chunks side by side along another dim can be told a bug."""
    rows = [a for a in axes if isinstance(pl[a], Shard) and pl[a].dim == 0]
    if rows:
        tensor_state.write(out, "gathered", (ctx.key, tuple(rows), count))


def rows_side_by_side(ctx: RuleContext, tensors, dim: int) -> tuple[int, ...]:
    """Axes on which ``tensors``, joined along ``dim`` != 0, are the row blocks of an all-gather
    of a dim-0 shard (see :func:`mark_gathered_rows`): Megatron's gather-along-the-last-dim
    applied to a sequence shard."""
    base = tensors[0]._base
    mark = tensor_state.read(base, "gathered") if base is not None else None
    if (dim == 0 or mark is None or mark[0] is not ctx.key or mark[2] != len(tensors)
            or any(t._base is not base for t in tensors) or chunk_dim(tensors) != 0):
        return ()
    return mark[1]


NO_TENSOR = ()  # a typed result without tensor outputs (e.g. ``.item()``)



class RuleContext(Protocol):
    """What a rule may read of the checker, and tell it (the checker is one)."""

    mesh: Mesh
    names: tuple[str, ...]  # the mesh axes, in order; a placement tuple has one entry per axis
    n: int
    sizes: tuple[int, ...]  # the axes' sizes
    index: tuple[int, ...]  # this rank's coordinate on each axis
    rank_sets: tuple[frozenset[int], ...]  # each axis's ranks
    key: tuple  # the interned mesh key a type and a rule's marks are stamped with
    rerun: bool  # the rule runs again, on the operands made V after its violation
    cuts: PositionCuts  # shards cut and joined again
    reshaped: dict[tuple, tuple]  # forward views by (output, input) shape

    def types(self, t: Any) -> tuple | None:
        """``t``'s placements (None where unknown), or None for an untyped value."""

    def zero(self, t: Any) -> bool:
        """Whether ``t`` is known to be all zeros."""

    def const(self, t: Any) -> bool:
        """Whether every element of ``t`` is known to be equal (zeros too)."""

    def accumulated(self, t: Any) -> bool:
        """Whether ``t`` is zeros that one value was added into."""

    def added_on_some_ranks(self, t: Any) -> bool:
        """Whether ``t`` is zeros a value was added into in a branch on the rank."""

    def unseen_scalar(self, t: torch.Tensor) -> bool:
        """Whether untyped ``t`` is a one-element value made before the region."""

    def update_inplace(self, t: torch.Tensor, pl: tuple | None,
                       transform: Callable[[tuple], tuple] | None = None, flags: Any = ...) -> None:
        """Retype ``t`` in place, and every tracked tensor overlapping its storage."""

    def remember_pieces(self, pieces: Any, source: tuple) -> None:
        """The pieces a split just made of a value typed ``source``."""

    def remember_rank_scalar(self, value: int | float, axes: tuple[int, ...]) -> None:
        """A Python number read from a value that differs per rank on ``axes``."""

    def count_varying_cut(self) -> int:
        """Number this by-rank cut of a varying tensor."""

    def paused(self) -> AbstractContextManager[None]:
        """A block whose ops run untyped."""

    def report(self, violation: Violation, func: Any, args: tuple) -> None:
        """Report ``violation`` of ``func`` on ``args`` besides the one the rule raises."""


Rule = Callable[..., Any]  # rule(ctx: RuleContext, args, kwargs, out) -> the result's placements


@dataclass(frozen=True)
class Refinement:
    """A rule that refines another: ``rule(base, ctx, args, kwargs, out)`` types ``ops`` and
    calls ``base``, the rule it refines, where it knows nothing more. ``base`` is the table key
    refined (an aten base name, a collective's (namespace, name)); None: each op's own entry as
    the registry has built it so far (a chain of refinements)."""

    ops: tuple
    rule: Callable[..., Any]
    base: Hashable | None = None


# --- helpers -------------------------------------------------------------------------------

def on_typed_operand(rule: Callable[..., Any]) -> Rule:
    """A rule of an op on one operand: ``rule(ctx, x, pl, args, kwargs, out)`` gets the first
    operand ``x`` and its placements ``pl``; an untyped operand gives an untyped result."""

    def typed(ctx: RuleContext, args, kwargs, out):
        pl = ctx.types(args[0])
        return None if pl is None else rule(ctx, args[0], pl, args, kwargs, out)

    typed.__name__ = typed.__qualname__ = rule.__name__
    typed.__wrapped__ = rule
    return typed


def arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any = None) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def gathered_objects(group: dist.ProcessGroup, mine: Any) -> list | None:
    """What every rank of ``group`` sends (``mine`` here), in group order; None where ranks
    cannot talk (fake groups)."""
    if dist.get_backend(group) == "fake":
        return None
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def is_partial(p: Placement | None) -> bool:
    return p is P or p is PAVG or p is PEVEN


def is_sum(p: Placement | None) -> bool:
    """P, or its refinement P(even): the global value is the sum over the axis."""
    return p is P or p is PEVEN


def stacks_as_pieces(p: Placement | None, x: torch.Tensor) -> bool:
    """A partial count whose ranks' pieces a gather may stack (collect), read as V.

    Reading P as V forgets the pending sum; for a value with a gradient that breaks the
    backward (the gradient of P is R, of V is V), so only integer and bool tensors (counts,
    indices, which have no gradient) qualify. The stacked result holds every rank's piece;
    summing over the stacked dim gives the total.
    """
    return is_sum(p) and not (x.is_floating_point() or x.is_complex())


def replicated(p: Placement | None) -> bool:
    return p is R or p is I


def shift_shards(pl: Pl, move: Callable[[int], int | None]) -> Pl:
    """Move each S(d) to S(move(d)); None from ``move`` makes that axis unknown."""
    out = []
    for p in pl:
        if isinstance(p, Shard):
            d = move(p.dim)
            out.append(None if d is None else moved(p, d))
        elif isinstance(p, Gathered):
            out.append(None)
        else:
            out.append(p)
    return tuple(out)
