"""Where an op was called from: the innermost frame outside torch, shardcheck and a harness."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

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
_SKIPPED: dict[str, bool] = {}  # _skipped by file name, under the current _SKIP_PREFIXES


@contextmanager
def harness_code(*paths: str) -> Iterator[None]:
    """Inside the block, violations are located past the code under ``paths`` (a harness that
    drives the library under test), as they are past torch and shardcheck."""
    global _SKIP_PREFIXES
    saved = _SKIP_PREFIXES
    _SKIP_PREFIXES = (*saved, *paths)
    _SKIPPED.clear()
    try:
        yield
    finally:
        _SKIP_PREFIXES = saved
        _SKIPPED.clear()


def _skipped(name: str) -> bool:
    """Whether frames of file ``name`` are passed over (torch, shardcheck, a harness)."""
    skipped = _SKIPPED.get(name)
    if skipped is None:
        skipped = _SKIPPED[name] = name.startswith(_SKIP_PREFIXES)
    return skipped


def user_location() -> str:
    """file:line of the innermost frame outside torch and shardcheck."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not _skipped(name):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def user_code_frame() -> FrameType | None:
    """The innermost frame outside torch and shardcheck (see :func:`user_location`)."""
    frame = sys._getframe(1)
    while frame is not None and _skipped(frame.f_code.co_filename):
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
        if name.startswith(_DISTRIBUTED):
            return None
        skipped = _SKIPPED.get(name)  # _skipped(name), its cached answer inlined
        if not (_skipped(name) if skipped is None else skipped):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"
