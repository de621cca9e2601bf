"""Branches on the rank: Python code that reads its rank in a group and decides on it.

``if rank == 0: x = x + b`` runs other ops on each rank; each rank types the ops it ran, so a
replicated value changed on one rank only would still read R. Inside ``typecheck``,
``torch.distributed.get_rank`` returns the rank as a :class:`RankNumber` when user code asks
for a group of mesh axes: an int that, when compared or tested, tells the checker that the
calling frame decided on the rank. The ops that frame runs from then on are typed V on those
axes unless their rule proves otherwise (see ``Checker._after_rank_branch``).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

_TORCH = os.path.dirname(torch.__file__) + os.sep
_TYPECHECK = os.path.dirname(os.path.abspath(__file__)) + os.sep
MACHINERY = (_TORCH, _TYPECHECK, os.path.dirname(functools.__file__) + os.sep + "functools.py")
_DECISIONS_KEPT = 32


class RankNumber(int):
    """A rank read by user code (see the module docstring); ``on(frame)`` is told of each
    comparison or truth test."""

    def __new__(cls, value: int, seen: Callable[[FrameType], None] | None = None) -> RankNumber:
        self = super().__new__(cls, value)
        self._seen = seen
        return self

    def _decided(self) -> None:
        frame = sys._getframe(2)
        if self._seen is not None and not frame.f_code.co_filename.startswith(MACHINERY):
            self._seen(frame)

    def __eq__(self, other: object) -> bool:
        self._decided()
        return int.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        self._decided()
        return int.__ne__(self, other)

    def __lt__(self, other: Any) -> bool:
        self._decided()
        return int.__lt__(self, other)

    def __le__(self, other: Any) -> bool:
        self._decided()
        return int.__le__(self, other)

    def __gt__(self, other: Any) -> bool:
        self._decided()
        return int.__gt__(self, other)

    def __ge__(self, other: Any) -> bool:
        self._decided()
        return int.__ge__(self, other)

    def __bool__(self) -> bool:
        self._decided()
        return int(self) != 0

    __hash__ = int.__hash__

    def __reduce__(self):
        return int, (int(self),)


class RankBranches:
    """The frames that decided on the rank, and on which mesh axes (the latest few)."""

    def __init__(self) -> None:
        self._frames: dict[int, tuple[FrameType, tuple[int, ...]]] = {}

    def __bool__(self) -> bool:
        return bool(self._frames)

    def decided(self, frame: FrameType, axes: tuple[int, ...]) -> None:
        if len(self._frames) >= _DECISIONS_KEPT:
            self._frames.pop(next(iter(self._frames)))
        known = self._frames.get(id(frame))
        if known is not None and known[0] is frame:
            axes = tuple(sorted({*known[1], *axes}))
        self._frames[id(frame)] = (frame, axes)

    def axes_here(self) -> tuple[int, ...]:
        """The axes the frame running the current op decided on (empty when it did not)."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(MACHINERY):
            frame = frame.f_back
        known = self._frames.get(id(frame)) if frame is not None else None
        return known[1] if known is not None and known[0] is frame else ()

    def clear(self) -> None:
        self._frames.clear()


_get_rank = dist.get_rank
_installed: list[Callable[[Any], tuple[int, ...] | None]] = []


def _watched_get_rank(group: Any = None) -> int:
    rank = _get_rank(group)
    caller = sys._getframe(1).f_code.co_filename
    if not _installed or rank < 0 or caller.startswith(MACHINERY):
        return rank
    seen = _installed[-1](group)
    return rank if seen is None else RankNumber(rank, seen)


def watch(on_read: Callable[[Any], Callable[[FrameType], None] | None]) -> None:
    """Make ``get_rank`` return RankNumbers; ``on_read(group)`` gives the callback for a
    comparison of the rank read for ``group`` (None: return a plain int)."""
    if not _installed:
        dist.get_rank = dist.distributed_c10d.get_rank = _watched_get_rank
    _installed.append(on_read)


def unwatch(on_read: Callable) -> None:
    _installed.remove(on_read)
    if not _installed:
        dist.get_rank = dist.distributed_c10d.get_rank = _get_rank
