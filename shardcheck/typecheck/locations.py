"""Where an op was called from: the innermost frame outside torch, shardcheck and a harness."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType, FrameType

import torch
import typing_extensions

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DISTRIBUTED = os.path.join(os.path.dirname(torch.__file__), "distributed") + os.sep
_SKIP_PREFIXES = (
    os.path.dirname(torch.__file__) + os.sep,
    _HERE,
    os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py",
    os.path.dirname(functools.__file__) + os.sep + "functools.py",
    typing_extensions.__file__,
    "<frozen",
)
_KINDS: dict[str, int] = {}  # _kind by file name, under the current _SKIP_PREFIXES
# "file:line" by the id of a code object (kept, so that the id stays its own) and an offset in
# it: a frame's line is decoded from its code's line table, at each op that asks otherwise
_LOCATIONS: dict[int, tuple[CodeType, dict[int, str]]] = {}
_LOCATIONS_KEPT = 4096  # code objects kept at most (all dropped past it: code generated and run)
_TRACE_FRAME = re.compile(r'File "([^"]*)", line (\d+), in ')  # a frame of a formatted traceback


@contextmanager
def harness_code(*paths: str) -> Iterator[None]:
    """Inside the block, violations are located past the code under ``paths`` (a harness that
    drives the library under test), as they are past torch and shardcheck."""
    global _SKIP_PREFIXES
    saved = _SKIP_PREFIXES
    _SKIP_PREFIXES = (*saved, *paths)
    _KINDS.clear()
    try:
        yield
    finally:
        _SKIP_PREFIXES = saved
        _KINDS.clear()


_USER, _PASSED, _COLLECTIVE = 0, 1, 2  # what a file's frames are (see _kind)


def _kind(name: str) -> int:
    """Whether frames of file ``name`` are the user's, passed over (torch, shardcheck, a
    harness), or torch.distributed's (passed over too), cached by file name."""
    kind = _KINDS.get(name)
    if kind is None:
        kind = _KINDS[name] = (_COLLECTIVE if name.startswith(_DISTRIBUTED) else
                               _PASSED if name.startswith(_SKIP_PREFIXES) else _USER)
    return kind


def user_location() -> str:
    """file:line of the innermost frame outside torch and shardcheck."""
    frame = user_code_frame()
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def engine_node() -> torch.autograd.graph.Node | None:
    """The autograd node the op runs for when the autograd engine runs it directly (a C++
    backward node, no Python frame of its own); None in the forward or in a Python ``backward``."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    frame, user = sys._getframe(1), user_code_frame()
    while frame is not None and frame is not user and frame.f_code.co_name != "_engine_run_backward":
        frame = frame.f_back
    return node if frame is not None and frame is not user else None


def violation_site(node: torch.autograd.graph.Node | None) -> str:
    """Where a violation of an op is located: :func:`user_location`, but for an op the engine
    runs for ``node`` whose forward traceback anomaly mode kept (``torch.autograd.detect_anomaly``),
    the innermost frame outside torch and shardcheck of that traceback: the forward line that
    made the node (the ``split`` whose backward ``cat`` adds a partial gradient to a replicated one)."""
    trace = node.metadata.get("traceback_") if node is not None else None
    frames = _TRACE_FRAME.findall("".join(trace)) if trace else []
    forward = [f"{path}:{line}" for path, line in frames if _kind(path) == _USER]
    return forward[-1] if forward else user_location()


def user_code_frame() -> FrameType | None:
    """The innermost frame outside torch and shardcheck (see :func:`user_location`)."""
    frame = sys._getframe(1)
    while frame is not None and _kind(frame.f_code.co_filename) != _USER:
        frame = frame.f_back
    return frame


def inside_collective() -> bool:
    """Whether the op runs inside torch.distributed (a collective moving its own data)."""
    return op_site() is None


def op_site() -> str | None:
    """:func:`user_location`, or None inside torch.distributed (:func:`inside_collective`):
    both from one walk of the stack (coverage by site asks both at every op)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        kind = _KINDS.get(name)  # _kind(name), its cached answer inlined
        if kind is None:
            kind = _kind(name)
        if kind == _USER:
            return _location(frame)
        if kind == _COLLECTIVE:
            return None
        frame = frame.f_back
    return "<unknown>"


def _location(frame: FrameType) -> str:
    """``frame``'s "file:line", cached by its code and offset (see _LOCATIONS)."""
    code = frame.f_code
    known = _LOCATIONS.get(id(code))
    if known is None or known[0] is not code:
        if len(_LOCATIONS) >= _LOCATIONS_KEPT:
            _LOCATIONS.clear()
        known = _LOCATIONS[id(code)] = (code, {})
    at = frame.f_lasti
    location = known[1].get(at)
    if location is None:
        location = known[1][at] = f"{code.co_filename}:{frame.f_lineno}"
    return location
