"""Why an unknown type began: the cause, in words, of an op call that gave no type.

Coverage by site (``typecheck(..., sites=True)``) follows an unknown value back to the op that
made it: its origin. Only that first op asks here why (the unknown path only: a typed op never
does), and the answer is one of

- the checker reported a violation at the op's line (its result has no type past it);
- an input entered the checked region untyped (made before it or while the checker paused: a
  global buffer, a cache, a parameter nothing typed, a harness value), named by its kind,
  dtype and shape;
- no rule types the op;
- the op's rule gave no type to these input types (shown per axis, ``?`` where unknown); a
  slice that is this rank's chunk on several axes alike says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardcheck.typecheck.rules.common import norm_dim
from shardcheck.typecheck.rules.shape import rank_piece

ENTERED = "entered the checked region untyped"
NO_RULE = "no rule for"
DECLINED = "gives no type to"
AFTER = "follows the violation"


def cause(checker: Any, op: Any, args: Iterable[Any], ruled: bool, location: str = "") -> str:
    """Why ``op`` (an OpOverload) made an unknown from ``args``, none of them carrying an
    unknown's origin: ``ruled`` when a rule for it ran and gave no type. A violation the
    checker reported at ``location`` comes first: its result has no type past it."""
    name = f"{op.namespace}.{op._opname}"
    broken = sorted({r.rule for r in checker.records if r.location == location})
    if broken:
        return f"{name} {AFTER} ({', '.join(broken)}) reported there"
    tensors = list(_tensors(args))
    for i, t in enumerate(tensors):
        if checker.types(t) is None:
            return f"input {i} ({_kind(t)} {_shape(t)}) {ENTERED}"
    if not ruled:
        return f"{NO_RULE} {name}"
    if op._opname == "slice" and (ambiguous := _ambiguous_rank_cut(checker, args)):
        return ambiguous
    shown = ", ".join(checker.render(t) for t in tensors) or "no tensor"
    return f"{name}'s rule {DECLINED} {shown}"


def _ambiguous_rank_cut(checker: Any, args: Any) -> str | None:
    """For a slice whose piece is this rank's chunk on several axes alike (its index on them is
    the same here, or it is its chunk of their product), what it cut and on which axes: the
    rule cannot tell which group's rank chose the piece (a rank read as a plain number)."""
    x, dim, start, end = (list(args) + [0, 0, None])[:4]
    step = args[4] if len(args) > 4 else 1
    pl = checker.types(x)
    if pl is None or step != 1:
        return None
    dim = norm_dim(dim, x.dim())
    size = x.shape[dim]
    start = max(0, min(size, norm_dim(start or 0, size)))
    stop = size if end is None else max(start, min(size, norm_dim(end, size)))
    axes = rank_piece(checker, pl, dim, size, start, stop - start, False)
    if len(axes) < 2 or any(p is not None for p in axes.values()):
        return None
    names = " and ".join(checker.names[a] for a in sorted(axes))
    return (f"aten.slice [{start}:{stop}] of dim {dim} is this rank's chunk by its rank on {names} "
            f"alike: which group's rank chose it is not known")


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
