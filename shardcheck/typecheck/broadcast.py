"""Dims along which a tensor holds one value, known from how it was made (not from its values).

The gradient of a sum over a dim reaches the summed tensor as an ``expand`` of one row along
that dim; elementwise ops on it keep that. Such an operand is the local piece of a global
broadcast, so it fits any shard of that dim. Views keep what they can of it: a broadcast dim
merged after another dim (``[b, n, h] -> [b * n, h]`` with ``n`` broadcast, as Megatron's
attention views a repeated key) holds one value in each of ``b`` blocks, so it fits a shard
of that dim in ``b`` blocks. Dims count from the end (-1 is the last), so they line up across
broadcasting operands. A recorded tag is trusted only while the tensor's version counter is
unchanged: any in-place write, through any view, drops it.
"""

from __future__ import annotations

from typing import Any

import torch

from shardcheck.typecheck import tensor_state

# Out-of-place elementwise ops: their result is a broadcast along the dims all operands are.
ELEMENTWISE = {
    "add", "sub", "rsub", "mul", "div", "true_divide", "neg", "where", "exp", "log", "sqrt",
    "rsqrt", "pow", "reciprocal", "sigmoid", "tanh", "abs", "clone", "detach", "alias",
    "_to_copy", "contiguous", "positive", "sigmoid_backward", "tanh_backward",
}
VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias"}
MOVES = {"transpose", "permute"}

Blocks = dict[int, int]  # dim (negative) -> the number of blocks it holds one value in (1: whole)


def broadcast_blocks(t: torch.Tensor) -> Blocks:
    """The dims (negative) along which ``t`` holds one value in each of so many blocks: size 1,
    stride 0 or recorded whole (1 block), or recorded in blocks."""
    tag = tensor_state.read(t, "broadcast")
    blocks = dict(tag[1]) if tag is not None and tag[0] == t._version else {}
    if t.layout is torch.strided:
        blocks.update((d - t.dim(), 1) for d in range(t.dim()) if t.shape[d] == 1 or t.stride(d) == 0)
    return blocks


def broadcast_dims(t: torch.Tensor) -> frozenset[int]:
    """The dims (negative) along which ``t`` holds one value: size 1, stride 0, or recorded."""
    return frozenset(d for d, outer in broadcast_blocks(t).items() if outer == 1)


def fits_shard(t: torch.Tensor, dim: int, outer: int = 1) -> bool:
    """Whether ``t`` holds one value along ``dim`` in each of ``outer`` blocks (or whole), so
    that it is the local piece of a global broadcast along a shard of ``dim`` in ``outer`` blocks."""
    found = broadcast_blocks(t).get(dim - t.dim() if dim >= 0 else dim)
    return found is not None and outer % found == 0


def op_kind(func) -> str:
    """What :func:`record` does for ``func``: "expand", "keep", "view", "move" or "" (nothing)."""
    name = func.__name__.split(".")[0]
    if name == "expand":
        return "expand"
    if name in VIEWS:
        return "view"
    return "move" if name in MOVES else ("keep" if name in ELEMENTWISE else "")


def _of_operand(x: Any, ndim: int) -> Blocks | None:
    """An operand's broadcast blocks in an ``ndim``-dim result; None for non-tensors."""
    if not isinstance(x, torch.Tensor):
        return None
    blocks = broadcast_blocks(x)
    blocks.update((d, 1) for d in range(-ndim, -x.dim()))
    return blocks


def _common(found: list[Blocks]) -> Blocks:
    """The blocks every operand holds one value in: a whole broadcast fits any block count."""
    common = {}
    for d in set.intersection(*(set(b) for b in found)):
        counts = {b[d] for b in found} - {1}
        if len(counts) <= 1:
            common[d] = counts.pop() if counts else 1
    return common


def _groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Dims of shapes ``a`` and ``b`` (same numel) paired into runs of equal size, as a
    reshape maps them; None where it cannot say (empty tensors)."""
    if 0 in a or 0 in b:
        return None
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ins, outs, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ins.append(i)
                pa, i = pa * a[i], i + 1
            elif pb < pa and j < len(b):
                outs.append(j)
                pb, j = pb * b[j], j + 1
            else:
                return None
        groups.append((ins, outs))
    return groups


def _run_length(shape, dims: list[int], blocks: Blocks, ndim: int) -> int:
    """How many consecutive elements of the dims ``dims`` flattened hold one value."""
    run = 1
    for d in reversed(dims):
        outer = blocks.get(d - ndim)
        if outer is None:
            break
        run *= shape[d] // outer
        if outer != 1:
            break
    return run


def _viewed(in_shape, out_shape, blocks: Blocks) -> Blocks:
    """A reshape's broadcast blocks from its input's."""
    groups = _groups(tuple(in_shape), tuple(out_shape))
    result: Blocks = {}
    for ins, outs in groups or ():
        run, after = _run_length(in_shape, ins, blocks, len(in_shape)), 1
        for d in reversed(outs):
            size = out_shape[d]
            if run % after or run // after == 1:
                break
            block = run // after
            if block % size == 0 and size > 1:
                result[d - len(out_shape)] = 1
            elif size % block == 0:
                result[d - len(out_shape)] = size // block
            after *= size
    return result


def _moved(func, args: tuple, out: torch.Tensor, blocks: Blocks) -> Blocks:
    """transpose / permute: the dims go where the op puts them."""
    ndim = out.dim()
    if func.__name__.startswith("permute"):
        order = [d % ndim for d in args[1]]
    else:
        d0, d1 = (args[1] % ndim, args[2] % ndim) if len(args) > 2 else (0, max(ndim - 1, 0))
        order = list(range(ndim))
        order[d0], order[d1] = order[d1], order[d0]
    return {k - ndim: blocks[d - ndim] for k, d in enumerate(order) if d - ndim in blocks}


def record(kind: str, func, args: tuple, out: Any) -> None:
    """Tag ``out`` with the dims it is a broadcast along, for expand, elementwise ops and views
    (``kind``: what :func:`op_kind` says of ``func``, not "")."""
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        return
    if kind != "expand" and not tensor_state.any_set(args, "broadcast"):
        return
    if kind in ("view", "move"):
        blocks = broadcast_blocks(args[0])
        blocks = (_viewed(args[0].shape, out.shape, blocks) if kind == "view"
                  else _moved(func, args, out, blocks))
    else:
        found = [b for b in (_of_operand(a, out.dim()) for a in args) if b is not None]
        if not found:
            return
        blocks = _common(found) if kind == "keep" else found[0]
    blocks = {d: o for d, o in blocks.items() if d >= -out.dim() and out.shape[d] != 1}
    if blocks:
        tensor_state.write(out, "broadcast", (out._version, blocks))
