"""Branches on the rank: Python code that reads its rank in a group and decides on it.

``if rank == 0: x = x + b`` runs other ops on each rank; each rank types the ops it ran, so a
replicated value changed on one rank only would still read R (so would ``x * float(rank == 0)``,
which computes with the comparison without branching). Inside ``typecheck``,
``torch.distributed.get_rank`` returns the rank as a :class:`RankNumber` when user code asks
for a group of mesh axes: an int that, when compared or tested, tells the checker that the
calling frame branches on the rank. The ops that frame runs inside the branch (from the jump
that tests the rank to where the branches meet again) are typed V on those axes unless their
rule proves otherwise (see ``Checker._after_rank_branch``); so are the ops of the rest of the
line of a comparison that is not branched on. A comparison stored in a variable and tested
later, or a branch that calls a function, is not followed.

A rank read as the index of a subscript (``x.chunk(n)[get_rank(group)]``) tells the checker
which of the pieces a split just made each rank picks (``Checker.picked_by_rank``).

Numbers computed from a rank (``rank * size``, ``(rank + 1) * n // size``), of ``get_rank`` or
of ``ProcessGroup.rank()``, are :class:`RankDerived`: ints that remember the mesh axes whose
rank they came from, and nothing else (comparing them is no branch). A slice that is this
rank's chunk on several axes alike asks :func:`bound_axes` which axes' rank computed its
bounds (GDN's and Mamba's cp slices of their parameters, at a rank whose dp index is its cp
index).
"""

from __future__ import annotations

import dis
import functools
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

_TORCH = os.path.dirname(torch.__file__) + os.sep
_TYPECHECK = os.path.dirname(os.path.abspath(__file__)) + os.sep
MACHINERY = (_TORCH, _TYPECHECK, os.path.dirname(functools.__file__) + os.sep + "functools.py")
_DECISIONS_KEPT = 32
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


class _Derives(int):
    """Int arithmetic that keeps the mesh axes (``axes``) of the rank a number came from."""

    axes: tuple[int, ...] = ()

    def _derived(self, value: Any, other: Any = None) -> Any:
        if type(value) is not int:
            return value
        return RankDerived(value, tuple(sorted({*self.axes, *getattr(other, "axes", ())})))

    __hash__ = int.__hash__

    def __reduce__(self):
        return int, (int(self),)


def _keeping_axes(name: str) -> Any:
    """``int``'s operator ``name``, whose int result keeps the operands' mesh axes."""
    operator = getattr(int, name)

    def method(self: _Derives, other: Any) -> Any:
        return self._derived(operator(self, other), other)

    method.__name__ = name
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__mod__"):
    setattr(_Derives, _name, _keeping_axes(_name))


class RankDerived(_Derives):
    """A number computed from a rank read on mesh ``axes`` (see the module docstring)."""

    def __new__(cls, value: int, axes: tuple[int, ...]) -> RankDerived:
        self = super().__new__(cls, value)
        self.axes = axes
        return self


class RankNumber(_Derives):
    """A rank read by user code (see the module docstring); ``on(frame)`` is told of each
    comparison or truth test."""

    def __new__(cls, value: int, seen: Callable[[FrameType], None] | None = None,
                axes: tuple[int, ...] = ()) -> RankNumber:
        self = super().__new__(cls, value)
        self._seen = seen
        self.axes = axes
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

    __hash__ = int.__hash__  # defining __eq__ dropped the inherited one



class RankBranches:
    """The code the latest few frames run under a branch on the rank, and on which mesh axes:
    from the jump that tests the rank to where the branches meet again."""

    def __init__(self) -> None:
        # id(frame) -> (frame, [(jump, merge, axes)]); empty until code branches on the rank
        self.frames: dict[int, tuple[FrameType, list[tuple[int, int, tuple[int, ...]]]]] = {}
        # (frame, jump, merge) of each span in ``frames``, flat (see running_span)
        self.spans: list[tuple[FrameType, int, int]] = []

    def decided(self, frame: FrameType, axes: tuple[int, ...]) -> None:
        span = branch_span(frame.f_code, frame.f_lasti) or statement_span(frame.f_code, frame.f_lasti)
        if span is None:
            return
        known = self.frames.get(id(frame))
        if known is None or known[0] is not frame:
            self._forget_returned()
            if len(self.frames) >= _DECISIONS_KEPT:
                self.frames.pop(next(iter(self.frames)))
            known = self.frames[id(frame)] = (frame, [])
            self.spans = [(f, start, end) for f, spans in self.frames.values()
                          for start, end, _ in spans]
        if (*span, axes) not in known[1]:  # a branch in a loop is one span
            known[1].append((*span, axes))
            self.spans.append((frame, *span))

    def _forget_returned(self) -> None:
        """Forget the kept frames that returned (on no thread's stack, and no generator's or
        coroutine's, which may resume): they run no op again, and every aten op scans the
        spans of the frames kept (a helper that tests the rank, called once per layer, left
        one each; see :meth:`axes_here`)."""
        running = set()
        for top in sys._current_frames().values():
            while top is not None:
                running.add(id(top))
                top = top.f_back
        returned = [key for key, (f, _) in self.frames.items()
                    if key not in running and not f.f_code.co_flags & _RESUMABLE]
        for key in returned:
            del self.frames[key]

    def clear(self) -> None:
        """Forget the frames (they hold their locals)."""
        self.frames.clear()
        self.spans = []

    def axes_here(self) -> tuple[int, ...]:
        """The axes on which the code running the current op is under a branch on the rank.

        The stack is walked only while some kept frame runs inside one of its branches (it
        seldom does): the op's own frame can be under a branch only then. The dispatch makes
        that test inline (``spans``, one call less per aten op) and calls this only then."""
        for kept, start, end in self.spans:
            if start < kept.f_lasti < end:
                break
        else:
            return ()
        frame = user_frame(sys._getframe(1))
        known = self.frames.get(id(frame)) if frame is not None else None
        if known is None or known[0] is not frame:
            return ()
        at = frame.f_lasti
        return tuple(sorted({a for start, end, axes in known[1] if start < at < end for a in axes}))


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame from ``frame`` up that runs user code (not torch's or the checker's)."""
    while frame is not None and frame.f_code.co_filename.startswith(MACHINERY):
        frame = frame.f_back
    return frame


@functools.lru_cache(maxsize=256)
def _instructions(code) -> tuple[dis.Instruction, ...]:
    return tuple(dis.get_instructions(code))


def _after(instructions: tuple[dis.Instruction, ...], offset: int) -> int:
    """The index of the first instruction past ``offset``."""
    return next((i for i, ins in enumerate(instructions) if ins.offset > offset), len(instructions))


def subscript_site(frame: FrameType) -> tuple[FrameType, int] | None:
    """(frame, offset) of the subscript that the value of the call running in ``frame`` is
    the index of (``pieces[get_rank(group)]``), through the returns of the functions that
    hand it on (``get_tensor_model_parallel_rank()``); None when it is used otherwise."""
    while frame is not None:
        instructions = _instructions(frame.f_code)
        at = _after(instructions, frame.f_lasti)
        while at < len(instructions) and instructions[at].opname == "JUMP_FORWARD":  # out of an if-else
            at = _after(instructions, instructions[at].argval - 1)
        following = instructions[at].opname if at < len(instructions) else None
        if following != "RETURN_VALUE":
            return (frame, instructions[at].offset) if following == "BINARY_SUBSCR" else None
        frame = frame.f_back
    return None


_PURE_PUSHES = {"PUSH_NULL", "LOAD_FAST", "LOAD_CONST", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME"}


def subscripts_result(code, call: int, subscript: int) -> bool:
    """Whether the subscript at offset ``subscript`` indexes the value that the call at
    offset ``call`` left on the stack, the code in between only computing the index: it
    pushes first, and nothing there pops down to that value (nor jumps)."""
    instructions = _instructions(code)
    between = [ins for ins in instructions[_after(instructions, call):] if ins.offset < subscript]
    if not between or between[0].opname not in _PURE_PUSHES:
        return False
    depth = 0
    for ins in between:
        if "JUMP" in ins.opname:
            return False
        depth += dis.stack_effect(ins.opcode, ins.arg if ins.opcode >= dis.HAVE_ARGUMENT else None)
        if depth < 1:
            return False
    return depth == 1


def branch_span(code, offset: int) -> tuple[int, int] | None:
    """(jump, merge): the code offsets between the conditional jump that tests the comparison
    at ``offset`` and where its branches meet again (past the else branch, if any); None when
    no conditional jump follows the comparison."""
    instructions = _instructions(code)
    at = next((i for i, ins in enumerate(instructions) if ins.offset >= offset), None)
    if at is None:
        return None
    jump = next((ins for ins in instructions[at:at + 2] if _forward_test(ins)), None)
    if jump is None:
        return None
    target = jump.argval
    before = next((ins for ins in reversed(instructions) if ins.offset < target), None)
    merge = before.argval if before is not None and before.opname.startswith("JUMP_FORWARD") else target
    return jump.offset, max(target, merge)


def statement_span(code, offset: int) -> tuple[int, int] | None:
    """(comparison, end of its line): the rest of the statement that computes with a comparison
    it does not branch on (``term * float(rank == 0)``: the term on the first rank only); None
    when nothing follows it on the line. A comparison stored and tested later is not followed."""
    instructions = _instructions(code)
    at = _after(instructions, offset)
    end = next((ins.offset for ins in instructions[at:] if ins.starts_line is not None), None)
    if end is None:
        end = instructions[-1].offset + 2
    return (offset, end) if at < len(instructions) and instructions[at].offset < end else None


def _forward_test(ins: dis.Instruction) -> bool:
    return ("JUMP" in ins.opname and "IF_" in ins.opname and isinstance(ins.argval, int)
            and ins.argval > ins.offset)


@dataclass(frozen=True)
class RankUse:
    """What the checker is told of a rank read for some mesh axes: ``decided(frame)`` when
    ``frame`` compares or tests it, ``picked(frame, subscript, rank)`` when it is the index
    of the subscript at that offset (see :func:`subscript_site`)."""

    decided: Callable[[FrameType], None]
    picked: Callable[[FrameType, int, int], None]
    axes: tuple[int, ...] = ()  # the mesh axes of the group


_get_rank = dist.get_rank
_group_rank = dist.ProcessGroup.rank  # the C++ method, called as a function
_group_rank_method = dist.ProcessGroup.__dict__["rank"]  # what the class holds (restored as is)
_installed: list[Callable[[Any], RankUse | None]] = []


def _watched_group_rank(group: Any) -> int:
    """``ProcessGroup.rank``: a :class:`RankDerived` for user code, when the group is of mesh axes."""
    rank = _group_rank(group)
    if not _installed or rank < 0 or sys._getframe(1).f_code.co_filename.startswith(MACHINERY):
        return rank
    use = _installed[-1](group)
    return rank if use is None else RankDerived(rank, use.axes)


def bound_axes(start: int, stop: int, frames: int = 3) -> set[int]:
    """The mesh axes of the :class:`RankDerived` numbers equal to ``start`` or ``stop`` in the
    locals of the innermost ``frames`` user frames (a slice's bounds, or the slices holding
    them: ``x[start:end]``, ``param[slices]``)."""
    found: set[int] = set()
    frame = user_frame(sys._getframe(1))
    for _ in range(frames):
        if frame is None:
            break
        for value in frame.f_locals.values():
            for item in (value if isinstance(value, (list, tuple)) and len(value) <= 8 else (value,)):
                for bound in ((item.start, item.stop) if isinstance(item, slice) else (item,)):
                    if isinstance(bound, _Derives) and bound in (start, stop):
                        found.update(bound.axes)
        frame = user_frame(frame.f_back)
    return found


def _watched_get_rank(group: Any = None) -> int:
    rank = _get_rank(group)
    caller = sys._getframe(1)
    if not _installed or rank < 0 or caller.f_code.co_filename.startswith(MACHINERY):
        return rank
    use = _installed[-1](group)
    if use is None:
        return rank
    site = subscript_site(caller)
    if site is not None:
        use.picked(*site, rank)
    return RankNumber(rank, use.decided, use.axes)


def watch(on_read: Callable[[Any], RankUse | None]) -> None:
    """Make ``get_rank`` return RankNumbers; ``on_read(group)`` says what to tell of the rank
    read for ``group`` (None: return a plain int)."""
    if not _installed:
        dist.get_rank = dist.distributed_c10d.get_rank = _watched_get_rank
        dist.ProcessGroup.rank = _watched_group_rank
    _installed.append(on_read)


def unwatch(on_read: Callable) -> None:
    _installed.remove(on_read)
    if not _installed:
        dist.get_rank = dist.distributed_c10d.get_rank = _get_rank
        dist.ProcessGroup.rank = _group_rank_method
