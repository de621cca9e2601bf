"""Why an unknown type began: the cause, in words, of an op call that gave no type.

Coverage by site (``typecheck(..., sites=True)``) follows an unknown value back to the op that
made it: its origin. Only that first op asks here why (the unknown path only: a typed op never
does), and the answer is one of

- an input entered the checked region untyped (made before it or while the checker paused: a
  global buffer, a cache, a parameter nothing typed, a harness value), named by its kind,
  dtype and shape;
- no rule types the op;
- the op's rule gave no type to these input types (shown per axis, ``?`` where unknown).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

ENTERED = "entered the checked region untyped"
NO_RULE = "no rule for"
DECLINED = "gives no type to"


def cause(checker: Any, op: Any, args: Iterable[Any], ruled: bool) -> str:
    """Why ``op`` (an OpOverload) made an unknown from ``args``, none of them carrying an
    unknown's origin: ``ruled`` when a rule for it ran and gave no type."""
    name = f"{op.namespace}.{op._opname}"
    tensors = list(_tensors(args))
    for i, t in enumerate(tensors):
        if checker.types(t) is None:
            return f"input {i} ({_kind(t)} {_shape(t)}) {ENTERED}"
    if not ruled:
        return f"{NO_RULE} {name}"
    shown = ", ".join(checker.render(t) for t in tensors) or "no tensor"
    return f"{name}'s rule {DECLINED} {shown}"


def _tensors(args: Iterable[Any]) -> Iterable[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def _kind(t: torch.Tensor) -> str:
    if isinstance(t, torch.nn.Parameter):
        return "a parameter"
    if t.dim() == 0:
        return "a 0-dim value"
    return "a tensor"


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(map(str, t.shape))}]"
