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
:func:`operand_root` reruns a crashed case that way and reads the note.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shardcheck.megatron.audit.rank import _megatron_core, run_case
from shardcheck.megatron.audit.sweep import Case, impl_of
from shardcheck.megatron.checks.contracts import _short
from shardcheck.megatron.checks.explicit import GENERIC
from shardcheck.parity.pool import PoolFailure
from shardcheck.typecheck.locations import user_code_frame

MADE_AT = "operand made at "
# what torch says when an op's operands have the wrong shape
SHAPE_ERROR = re.compile(r"\bshapes?\b|\bsizes?\b|\bdimensions?\b")
_NOTE = re.compile(rf"^{MADE_AT}(\S+:\d+) in (\S+)$", re.MULTILINE)


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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        frame = user_code_frame()
        try:
            out = func(*args, **(kwargs or {}))
        except Exception as exc:
            if frame is not None and SHAPE_ERROR.search(str(exc)):
                root = self.root(inputs, _short(frame.f_code.co_filename), frame.f_code.co_name)
                if root is not None:
                    exc.add_note(f"{MADE_AT}{root.site} in {root.function}")
            raise
        if frame is None or not frame.f_code.co_filename.startswith(self.within):
            return out
        site = f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
        made = tuple(m for m in map(self.of, inputs) if m is not None)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = (weakref.ref(t), Made(site, frame.f_code.co_name, made, tuple(t.shape)))
        return out

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


def made_at(traceback_text: str) -> tuple[str, str] | None:
    """(``file:line``, function) of a traceback's :data:`MADE_AT` note, or None."""
    found = _NOTE.findall(traceback_text)
    return found[-1] if found else None


def operand_root(pools: Any, case: Case) -> tuple[str, str] | None:
    """Where the operand of the op that raised the case's shape error was made, by a rerun of it
    noting its tensors' makers (:func:`traced_case`), or None (it did not raise a shape error
    in an op megatron-core called, or its operand was made in the raising function only)."""
    try:
        pools.run(case.layout, traced_case, case.component, case.options,
                  impl=impl_of(case.options, case.component))
    except PoolFailure as failure:
        return next((found for rank in sorted(failure.tracebacks)
                     if (found := made_at(failure.tracebacks[rank])) is not None), None)
    return None
