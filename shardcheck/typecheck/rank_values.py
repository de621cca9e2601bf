"""What values that differ per rank do to types: Python numbers read from them, a split's
pieces picked by rank, code that branches on the rank, zeros added into on some ranks."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.typecheck import rank_branches
from shardcheck.typecheck.locations import user_code_frame
from shardcheck.typecheck.rules.collectives import group_ranks
from shardcheck.typecheck.rules.common import replicated
from shardcheck.typecheck.rules.registry import WITH_ACC, WITH_ONE_RANK, Known, base_name
from shardcheck.typecheck.types import SectionShard, Shard, V


class RankValues:
    """The checker's handling of per-rank values (see the module docstring)."""

    def remember_rank_scalar(self, value: int | float, axes: tuple[int, ...]) -> None:
        """A Python number read (``.item()``) from a value that differs per rank on ``axes``, and
        the user code's frame that read it (see :meth:`_rank_scalar_axes`)."""
        if len(self.rank_scalars) >= 256:
            self.rank_scalars.pop(next(iter(self.rank_scalars)))
        frame = user_code_frame()
        self.rank_scalars[value] = (axes, None if frame is None else (id(frame), frame.f_code))

    def rank_read(self, group: Any) -> Callable | None:
        """What to do when the rank read for ``group`` (of some mesh axes) is compared: the
        comparing frame branches on the rank there (see :mod:`rank_branches`)."""
        try:
            names = self.mesh.axes_of(group_ranks(group if group is not None else dist.group.WORLD))
        except (RuntimeError, ValueError, TypeError):
            return None
        if not names:
            return None
        axes = tuple(self.names.index(n) for n in names)
        return rank_branches.RankUse(lambda frame: self.branches.decided(frame, axes),
                                     lambda frame, at, rank: self.picked_by_rank(frame, at, rank, axes), axes)

    def remember_pieces(self, pieces, source: tuple) -> None:
        """The pieces a split just made of a value typed ``source``, and the user code's call
        that made them (see :meth:`picked_by_rank`)."""
        frame = rank_branches.user_frame(sys._getframe(1))
        if frame is not None:
            self._pieces = (id(frame), frame.f_code, frame.f_lasti, [weakref.ref(t) for t in pieces], source)

    def picked_by_rank(self, frame, at: int, rank: int, axes: tuple[int, ...]) -> None:
        """The subscript at offset ``at`` of ``frame`` picks this rank's piece of the split
        that frame just made: of a value not replicated on the group's axes, one rank's chunk
        of each rank's own part (of a sum, of a shard along another dim) is no layout of a
        global value, so the piece is V there. Of a replicated value it is the rank's shard,
        which the slice rules tell by the piece's place already."""
        made = self._pieces
        if made is None or made[0] != id(frame) or made[1] is not frame.f_code:
            return
        _, code, call, pieces, source = made
        if all(replicated(source[a]) for a in axes) or not 0 <= rank < len(pieces):
            return
        piece = pieces[rank]()
        pl = self.types(piece)
        if pl is not None and rank_branches.subscripts_result(code, call, at):
            self.set_type(piece, _varied_on(pl, set(axes)), self._flags(piece))

    def _after_rank_branch(self, pl, args, flags: Known, axes: tuple[int, ...]):
        """An op run by a frame that branched on the rank: its ranks may run other ops, so
        its result is V on those axes, unless its rule proves the layout: this rank's piece of
        a replicated value (a slice by rank), zeros only this rank added into (ACC), V."""
        if flags in WITH_ACC:
            return pl
        source = self.types(args[0]) if args and isinstance(args[0], torch.Tensor) else None

        def branched(one):
            if one is None:
                return None
            return tuple(V if a in axes and p is not None and not (
                isinstance(p, Shard) and source is not None and replicated(source[a])) else p
                for a, p in enumerate(one))
        return [branched(one) for one in pl] if isinstance(pl, list) else branched(pl)

    def _rank_scalar_axes(self, args, kwargs) -> set[int]:
        """The axes the Python numbers given to an op differ on. A number is matched by value,
        while the frame that read it runs (the number is its local, or an argument of what it
        calls): once that code returned, an equal number is most likely another one (a size,
        an offset: finalize_model_grads cuts its coalesced buffer at a parameter's numel equal
        to a token count a dispatcher read), and it is forgotten."""
        axes: set[int] = set()
        for x in (*args, *kwargs.values()):
            if isinstance(x, int | float) and not isinstance(x, bool) and x in self.rank_scalars:
                varies, reader = self.rank_scalars[x]
                if reader is None or _running(reader):
                    axes.update(varies)
                else:
                    del self.rank_scalars[x]
        return axes

    def _varied_by_scalars(self, pl, func, args, kwargs):
        """An op given a Python number that differs per rank on some axes: V there, where its
        result was typed (an unknown stays unknown: the number may be a rank's own count of
        rows of a value cut there, whose sum over the ranks V would lose), except a slice of
        a sectioned dim, whose rule told its own sections (counts that differ by rank) apart."""
        axes = self._rank_scalar_axes(args, kwargs)
        source = self.types(args[0]) if axes and base_name(func) == "slice" else None
        if source:
            axes = {a for a in axes if not isinstance(source[a], SectionShard)}
        return _varied_on(pl, axes, typed_only=True)

    def _after_accumulation(self, pl, args):
        """An op on zeros a value was added into in a branch on the rank (ACC | ONE_RANK),
        other than a view or copy of them or their SUM all-reduce or reduce-scatter: on a
        replicated axis they are the value itself or one rank's contribution, which a rank
        cannot tell, so the result is V there."""
        axes = {a for t in args if isinstance(t, torch.Tensor) and self._flags(t) in WITH_ONE_RANK
                for a, p in enumerate(self.types(t)) if replicated(p)}
        return _varied_on(pl, axes)

    def count_varying_cut(self) -> int:
        """Number this by-rank cut of a varying tensor (the same on every rank of an SPMD run)."""
        self.varying_cuts += 1
        return self.varying_cuts


def _varied_on(pl, axes, typed_only: bool = False):
    """``pl`` (one result's placements, or a list of them) V on ``axes`` (``typed_only``: on
    those of them it typed)."""
    if not axes:
        return pl

    def vary(one):
        return None if one is None else tuple(
            V if a in axes and (p is not None or not typed_only) else p for a, p in enumerate(one))
    return [vary(one) for one in pl] if isinstance(pl, list) else vary(pl)


def _running(frame_key: tuple) -> bool:
    """Whether the frame of ``frame_key`` (its id and code) is on the current stack."""
    frame_id, code = frame_key
    frame = sys._getframe(1)
    while frame is not None:
        if id(frame) == frame_id and frame.f_code is code:
            return True
        frame = frame.f_back
    return False
