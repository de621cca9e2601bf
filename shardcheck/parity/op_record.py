"""Record the ops a region runs in one library's files: where each was called, and its outputs.

Each aten op called from a file under ``within`` (e.g. megatron-core's directory) is recorded
with its call site (``file:line`` and function), its name, and each floating output: a detached
copy and, inside a type checker's region, its placements by axis name. A backward op is located
at the forward line that made the autograd node it runs for (anomaly mode keeps that line on
each node), except inside a Python ``backward`` (an autograd Function), which is located where
it runs. Ops inside torch.distributed and collectives are not recorded: they move values, they
do not compute them; nor are those that allocate memory without writing it (``empty``), nor
the floating values made from integers and masks alone (token ids, a rank's vocabulary range:
where a layout's per-rank offsets live, which types say least of). The ``index`` of a record counts the earlier records of its key
(:meth:`OpRecord.key`) on this rank, so that two runs of one program align call by call.
"""

from __future__ import annotations

import re
import sys
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from shardcheck.typecheck.checker import current
from shardcheck.typecheck.locations import engine_node, inside_collective, user_code_frame

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
_TRACE_FRAME = re.compile(r'File "([^"]*)", line (\d+), in (\S+)')


@dataclass(frozen=True)
class OpRecord:
    """One op call: where, what, and its floating outputs (``None`` for a non-floating one)."""

    site: str  # file:line of the call (for a backward op: of the forward call that made its node)
    function: str
    op: str  # e.g. "aten.mm.default"
    backward: str  # the autograd node a backward op runs for (e.g. "MmBackward0"), "" in the forward
    index: int  # earlier records of the same key on this rank
    values: tuple[torch.Tensor | None, ...]
    placements: tuple[dict[str, str] | None, ...]  # per output: repr of each known placement
    mark: int = 0  # what the recorder's ``mark`` said when the op ran (e.g. the calls made so far)
    # a backward op's forward call stack under ``within``, outermost first: (file:line, function)
    stack: tuple[tuple[str, str], ...] = ()

    def key(self) -> tuple[str, str, str, str]:
        """What a call is aligned by across runs, with its ``index``."""
        return self.site, self.function, self.op, self.backward

    def describe(self) -> str:
        """``file:line in function: op``, and ``in NODE`` for a backward op."""
        op = self.op.removesuffix(".default")
        return f"{self.site} in {self.function}: {op}" + (f" in {self.backward}" if self.backward else "")


class _Recorder(TorchDispatchMode):
    def __init__(self, within: str, mark: Callable[[], int] | None, started: Callable[[], bool] | None,
                 probes: tuple[str, ...]) -> None:
        super().__init__()
        self.within, self.mark, self.started, self.probes = within, mark, started, probes
        self.records: list[OpRecord] = []
        self.from_integers: dict[int, weakref.ref] = {}  # floating values made from no float, by id
        self._counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.started is not None:
            if not self.started():
                return out
            self.started = None  # recording from here on
        if (func.namespace in COLLECTIVE_NAMESPACES or func._opname in UNINITIALIZED
                or inside_collective()):
            return out
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in outputs):
            return out
        if self._from_integers(args, kwargs):
            self.from_integers.update((id(t), weakref.ref(t)) for t in outputs if _floating(t))
            return out
        where = _call_site(self.within, self.probes)
        if where is None:
            return out
        site, function, backward, stack = where
        key = (site, function, str(func), backward)
        checker = current()
        with _disable_current_modes():
            values = tuple(t.detach().clone() if _floating(t) else None for t in outputs)
            placements = tuple(_placements(checker, t) if _floating(t) else None for t in outputs)
        self.records.append(OpRecord(site, function, str(func), backward, self._counts[key],
                                     values, placements, self.mark() if self.mark else 0, stack))
        self._counts[key] += 1
        return out


    def _from_integers(self, args: tuple, kwargs: dict | None) -> bool:
        """Whether the op's tensor inputs hold no floating value but one made from integers and
        masks alone (a cast mask, ``1.0 - mask``)."""
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return bool(inputs) and all(not t.is_floating_point() or self._made_from_integers(t) for t in inputs)

    def _made_from_integers(self, t: torch.Tensor) -> bool:
        held = self.from_integers.get(id(t))
        return held is not None and held() is t


def _floating(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _placements(checker, t: torch.Tensor) -> dict[str, str] | None:
    """The checker's known placements of ``t`` by axis name, as text; None outside a checker."""
    if checker is None:
        return None
    known = checker.types(t) or ()
    return {name: repr(p) for name, p in zip(checker.names, known, strict=False) if p is not None}


def _call_site(within: str, probes: tuple[str, ...] = ()) -> tuple[str, str, str, tuple] | None:
    """(file:line, function, autograd node or "", the node's forward stack under ``within``) of
    the op being dispatched, or None outside ``within`` or called by code under ``probes``.

    The innermost frame outside torch and shardcheck is the caller, unless the autograd engine
    runs between it and the op (a C++ backward node): then the node's forward traceback is."""
    if probes and _probed(within, probes):
        return None
    engine = engine_node()
    if engine is not None:  # a C++ node: where its forward op was called
        stack = _forward_stack(engine, within)
        return (*stack[-1], engine.name(), stack) if stack else None
    frame = user_code_frame()
    node = torch._C._current_autograd_node()
    name = node.name() if node is not None else ""
    if frame is None or not frame.f_code.co_filename.startswith(within):
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno}", frame.f_code.co_name, name, _forward_stack(node, within)


def _forward_stack(node: object, within: str) -> tuple[tuple[str, str], ...]:
    """The frames under ``within`` of the forward traceback that anomaly mode kept on ``node``
    (none outside a backward), outermost first, as (file:line, function)."""
    trace = node.metadata.get("traceback_") if node is not None else None
    frames = _TRACE_FRAME.findall("".join(trace)) if trace else []
    return tuple((f"{path}:{line}", function) for path, line, function in frames if path.startswith(within))


def _probed(within: str, probes: tuple[str, ...]) -> bool:
    """Whether a frame under ``probes`` runs between the op and the innermost frame under ``within``."""
    frame = sys._getframe(2)
    while frame is not None and not frame.f_code.co_filename.startswith(within):
        if frame.f_code.co_filename.startswith(probes):
            return True
        frame = frame.f_back
    return False


@contextmanager
def recording_ops(within: str, mark: Callable[[], int] | None = None, started: Callable[[], bool] | None = None,
                  probes: tuple[str, ...] = ()) -> Iterator[list[OpRecord]]:
    """Record the ops called from files under ``within`` in the block (see the module's doc);
    the yielded list receives them, in call order, at exit. Enter it inside a type checker's
    region for the placements of each output. ``mark``, called at each op, places it among other
    events of the run (its result is the record's ``mark``). With ``started``, the ops before it
    first says true are not recorded (e.g. building and initialising a model). Ops that code
    under ``probes`` calls itself (e.g. probes copying a result to record it) are not recorded."""
    recorder = _Recorder(within, mark, started, probes)
    found: list[OpRecord] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode's own warning
        with torch.autograd.detect_anomaly(check_nan=False), recorder:
            try:
                yield found
            finally:
                found.extend(recorder.records)
