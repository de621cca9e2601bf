"""Where the operand of a failing op was made: a shape crash's root in megatron-core.

A shape error raised by an op that megatron-core calls (``view``: ``shape '[16, 2, 16]' is
invalid for input of size 1024``) shows where the ill-shaped tensor was used; the bug is where
it was made, often in another function (Megatron-LM 16a8cdb64b: the attention output gate that
``get_query_key_value_tensors`` leaves unsliced fails to ``view`` in ``_apply_output_gate``).
:func:`operand_makers` notes, for each tensor an op called from megatron-core outputs, the line
that made it and where its inputs were made; when an op raises a shape error, the exception gets
a note (:data:`MADE_AT`) naming where its one operand was made, followed back through the raising
function's own ops (``contiguous``, a cast) to the first megatron-core line in another function
outside the generic layers.

An elementwise op of two operands that do not broadcast (``residual + out``: ``The size of
tensor a (32) must match the size of tensor b (16) at non-singleton dimension 2``) does not say
which is wrong; the exception then gets a note (:data:`OPERANDS`) with each operand's shape and
maker, followed back also through the generic layers (a reduce-scatter makes its output from its
input's shape) to the first megatron-core line outside them. The same op run on one rank tells
them apart: the wrong operand is the one whose size at that dim differs from its size there,
while the other's does not (Megatron's ``ColumnParallelLinearGathered`` under sequence
parallelism pads the sequence dim where it means the hidden one).
:func:`operand_root` reruns a crashed case that way and reads the note.
"""

from __future__ import annotations

import json
import re
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shardcheck.megatron.audit.rank import _megatron_core, run_case
from shardcheck.megatron.audit.sweep import Case, impl_of
from shardcheck.megatron.checks.explicit import GENERIC
from shardcheck.megatron.checks.paths import megatron_path
from shardcheck.parity.layout import Layout
from shardcheck.parity.pool import PoolFailure
from shardcheck.typecheck.locations import user_code_frame

MADE_AT = "operand made at "
OPERANDS = "operands of "  # then JSON: the failing call, its dim, each operand's shape and maker
# what torch says when an op's operands have the wrong shape
SHAPE_ERROR = re.compile(r"\bshapes?\b|\bsizes?\b|\bdimensions?\b")
# two operands that do not broadcast: the dim of the broadcast result where they part
UNBROADCAST = re.compile(r"must match the size of tensor b \(\d+\) at non-singleton dimension (\d+)")
_NOTE = re.compile(rf"^{MADE_AT}(\S+:\d+) in (\S+)$", re.MULTILINE)
_OPERANDS_NOTE = re.compile(rf"^{OPERANDS}(\{{.*\}})$", re.MULTILINE)


@dataclass(frozen=True)
class Made:
    """Where an op called from megatron-core made a tensor, and where its inputs were made."""

    site: str  # megatron/core/...py:NNN
    function: str
    inputs: tuple[Made, ...]
    shape: tuple[int, ...] = ()


class _Makers(TorchDispatchMode):
    def __init__(self, within: str) -> None:
        super().__init__()
        self.within = within
        self.made: dict[int, tuple[weakref.ref, Made]] = {}
        self.calls: Counter[str] = Counter()  # op calls by megatron-core line, so far

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        frame = user_code_frame()
        ours = frame is not None and frame.f_code.co_filename.startswith(self.within)
        site = f"{megatron_path(frame.f_code.co_filename)}:{frame.f_lineno}" if ours else ""
        if ours:
            self.calls[site] += 1
        try:
            out = func(*args, **(kwargs or {}))
        except Exception as exc:
            if frame is not None and SHAPE_ERROR.search(str(exc)):
                self.note(exc, inputs, frame, site)
            raise
        if not ours:
            return out
        made = tuple(m for m in map(self.of, inputs) if m is not None)
        for t in [*pytree.tree_leaves(out), *_written(func, args)]:
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = (weakref.ref(t), Made(site, frame.f_code.co_name, made, tuple(t.shape)))
        return out

    def note(self, exc: Exception, inputs: list[torch.Tensor], frame: Any, site: str) -> None:
        """Add to a shape error where its one operand was made (:data:`MADE_AT`), or for two
        operands that do not broadcast, both operands' shapes and makers (:data:`OPERANDS`)."""
        path, function = megatron_path(frame.f_code.co_filename), frame.f_code.co_name
        root = self.root(inputs, path, function)
        if root is not None:
            exc.add_note(f"{MADE_AT}{root.site} in {root.function}")
        elif site and len(inputs) == 2 and (parted := UNBROADCAST.search(str(exc))):
            makers = [self.outside(self.of(t), path, function) for t in inputs]
            exc.add_note(OPERANDS + json.dumps({
                "site": site, "call": self.calls[site], "dim": int(parted.group(1)),
                "shapes": [list(t.shape) for t in inputs],
                "makers": [[m.site, m.function] if m else None for m in makers]}))

    def outside(self, made: Made | None, path: str, function: str) -> Made | None:
        """The first maker back from ``made`` outside the raising function and the generic
        layers (through all of a maker's inputs), else None."""
        frontier, seen = [made], set()
        while frontier:
            m = frontier.pop(0)
            if m is None or id(m) in seen:
                continue
            seen.add(id(m))
            if (m.site.rsplit(":", 1)[0], m.function) != (path, function) and not m.site.startswith(GENERIC):
                return m
            frontier += m.inputs
        return None

    def of(self, t: torch.Tensor) -> Made | None:
        """Where ``t`` was made with the shape it has now, else None (not noted, or its data
        replaced since: ``tensor.data = ...``, as a checkpoint distributing its saved activations does)."""
        held = self.made.get(id(t))
        return held[1] if held is not None and held[0]() is t and held[1].shape == tuple(t.shape) else None

    def root(self, inputs: list[torch.Tensor], path: str, function: str) -> Made | None:
        """Where the op's one operand was made outside ``function`` of ``path`` (the raising
        one), followed back through that function's own ops on their first input. An op of
        several operands (``cat``, a product) does not say which has the wrong shape: none is
        named. One made in megatron-core's generic layers
        (:data:`~shardcheck.megatron.checks.explicit.GENERIC`: a gather, a checkpoint's
        activations) was made as their caller asked, so it names no root either: the raising
        line stays the crash's location."""
        if len(inputs) != 1:
            return None
        made = self.of(inputs[0])
        while made is not None and (made.site.rsplit(":", 1)[0], made.function) == (path, function):
            made = made.inputs[0] if made.inputs else None
        return made if made is not None and not made.site.startswith(GENERIC) else None


def _written(func: Any, args: tuple) -> list[torch.Tensor]:
    """The tensors a collective writes into (its schema's mutated arguments): their values, and
    so their shape's meaning, come from its other inputs."""
    if func.namespace != "c10d":
        return []
    written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    by_name = dict(zip((a.name for a in func._schema.arguments), args, strict=False))
    return [t for name in written for t in pytree.tree_leaves(by_name.get(name)) if isinstance(t, torch.Tensor)]


class _ShapesAt(TorchDispatchMode):
    """The operands' shapes of the ``call``-th op call at a megatron-core ``site``."""

    def __init__(self, site: str, call: int) -> None:
        super().__init__()
        self.site, self.call, self.seen = site, call, 0
        self.shapes: list[list[int]] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = user_code_frame()
        if frame is not None and f"{megatron_path(frame.f_code.co_filename)}:{frame.f_lineno}" == self.site:
            self.seen += 1
            if self.seen == self.call:
                self.shapes = [list(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return func(*args, **(kwargs or {}))


@contextmanager
def operand_makers(within: str) -> Iterator[None]:
    """Note where ops called from files under ``within`` make their tensors, and name, on a shape
    error an op raises in the block, where its operand was made (:data:`MADE_AT`)."""
    with _Makers(within):
        yield


def traced_case(ctx: Any, component: str, options: tuple) -> None:
    """On a rank: run the case (unchecked) noting where megatron-core made each tensor."""
    with operand_makers(_megatron_core()):
        run_case(ctx, component, options, (), False)


def shapes_at(ctx: Any, component: str, options: tuple, site: str, call: int) -> list[list[int]] | None:
    """On a rank: run the case (unchecked) and give the operands' shapes of the ``call``-th op
    call at ``site``, or None when it did not come."""
    with _ShapesAt(site, call) as found:
        run_case(ctx, component, options, (), False)
    return found.shapes


def made_at(traceback_text: str) -> tuple[str, str] | None:
    """(``file:line``, function) of a traceback's :data:`MADE_AT` note, or None."""
    found = _NOTE.findall(traceback_text)
    return found[-1] if found else None


def operands_noted(traceback_text: str) -> dict | None:
    """A traceback's :data:`OPERANDS` note, or None."""
    found = _OPERANDS_NOTE.findall(traceback_text)
    return json.loads(found[-1]) if found else None


def wrong_operand(noted: dict, alone: list[list[int]] | None) -> tuple[str, str] | None:
    """The maker of the one operand whose size at the parting dim differs from the same
    operand's on one rank (``alone``: the one-rank call's operand shapes), while the other's
    does not; else None."""
    shapes = noted["shapes"]
    if alone is None or [len(s) for s in alone] != [len(s) for s in shapes]:
        return None
    width = max(len(s) for s in shapes)
    changed = []
    for shape, one_rank in zip(shapes, alone, strict=True):
        dim = noted["dim"] - (width - len(shape))
        changed.append(0 <= dim < len(shape) and shape[dim] != one_rank[dim])
    if changed.count(True) != 1:
        return None
    maker = noted["makers"][changed.index(True)]
    return tuple(maker) if maker else None


def operand_root(pools: Any, case: Case) -> tuple[str, str] | None:
    """Where the operand of the op that raised the case's shape error was made, by a rerun of it
    noting its tensors' makers (:func:`traced_case`), or None (it did not raise a shape error
    in an op megatron-core called, or its operand was made in the raising function only). Of two
    operands that do not broadcast, the one run on one rank tells which (:func:`wrong_operand`;
    not under pipeline parallelism, where a stage's calls are not the one rank's)."""
    impl = impl_of(case.options, case.component)
    try:
        pools.run(case.layout, traced_case, case.component, case.options, impl=impl)
    except PoolFailure as failure:
        texts = [failure.tracebacks[rank] for rank in sorted(failure.tracebacks)]
        found = next((found for text in texts if (found := made_at(text)) is not None), None)
        noted = next((noted for text in texts if (noted := operands_noted(text)) is not None), None)
        if found is not None or noted is None or case.layout.pp > 1:
            return found
        try:
            [alone] = pools.run(Layout(), shapes_at, case.component, case.options, noted["site"], noted["call"],
                                impl=impl)
        except PoolFailure:
            return None
        return wrong_operand(noted, alone)
    return None
