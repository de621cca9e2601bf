"""Dims along which a tensor holds one value, known from how it was made (not from its values).

The gradient of a sum over a dim reaches the summed tensor as an ``expand`` of one row along
that dim; elementwise ops on it keep that. Such an operand is the local piece of a global
broadcast, so it fits any shard of that dim. Dims count from the end (-1 is the last), so they
line up across broadcasting operands. A recorded tag is trusted only while the tensor's version
counter is unchanged: any in-place write, through any view, drops it.
"""

from __future__ import annotations

from typing import Any

import torch

# Out-of-place elementwise ops: their result is a broadcast along the dims all operands are.
ELEMENTWISE = {
    "add", "sub", "rsub", "mul", "div", "true_divide", "neg", "where", "exp", "log", "sqrt",
    "rsqrt", "pow", "reciprocal", "sigmoid", "tanh", "abs", "clone", "detach", "alias",
    "_to_copy", "contiguous", "positive", "sigmoid_backward", "tanh_backward",
}
_KINDS: dict[int, str] = {}  # id(OpOverload) -> "expand", "keep" or "" (nothing to record)


def broadcast_dims(t: torch.Tensor) -> frozenset[int]:
    """The dims (negative) along which ``t`` holds one value: size 1, stride 0, or recorded."""
    tag = getattr(t, "_sc_broadcast", None)
    dims = set(tag[1]) if tag is not None and tag[0] == t._version else set()
    if t.layout is torch.strided:
        dims.update(d - t.dim() for d in range(t.dim()) if t.shape[d] == 1 or t.stride(d) == 0)
    return frozenset(dims)


def _kind(func) -> str:
    name = func.__name__.split(".")[0]
    return "expand" if name == "expand" else ("keep" if name in ELEMENTWISE else "")


def _of_operand(x: Any, ndim: int) -> frozenset[int] | None:
    """An operand's broadcast dims in an ``ndim``-dim result; None for non-tensors."""
    if not isinstance(x, torch.Tensor):
        return None
    missing = frozenset(range(-ndim, -x.dim())) if x.dim() < ndim else frozenset()
    return broadcast_dims(x) | missing


def record(func, args: tuple, out: Any) -> None:
    """Tag ``out`` with the dims it is a broadcast along, for expand and elementwise ops."""
    kind = _KINDS.get(id(func))  # OpOverloads live forever; id() hashes fastest
    if kind is None:
        kind = _KINDS[id(func)] = _kind(func)
    if not kind or not isinstance(out, torch.Tensor):
        return
    if kind == "keep":
        for a in args:
            if getattr(a, "_sc_broadcast", None) is not None:
                break
        else:
            return
    if out.dim() == 0:
        return
    found = [d for d in (_of_operand(a, out.dim()) for a in args) if d is not None]
    if not found:
        return
    dims = frozenset.intersection(*found) if kind == "keep" else found[0]
    dims = frozenset(d for d in dims if d >= -out.dim() and out.shape[d] != 1)
    if dims:
        out._sc_broadcast = (out._version, dims)
