"""Dims along which a tensor holds one value, known from how it was made (not from its values).

The gradient of a sum over a dim reaches the summed tensor as an ``expand`` of one row along
that dim; elementwise ops on it keep that. Such an operand is the local piece of a global
broadcast, so it fits any shard of that dim. Views keep what they can of it. A dim is known as
``(outer, period)``: read as ``[outer, n, period]``, it holds one value along ``n`` (``(1, 1)``:
one value along the whole dim). A broadcast dim merged after another dim (``[b, n, h] ->
[b * n, h]`` with ``n`` broadcast, as Megatron's attention views a repeated key) is ``(b, 1)``:
one value in each of ``b`` blocks, so it fits a shard of that dim in ``b`` blocks. A broadcast
dim merged before another (``[n, b * h] -> [n * b, h]``, the gradient of a sum over the
sequence of scores viewed ``[s, b * e]``) is ``(1, b)``: it repeats every ``b`` rows, so it fits
any shard whose pieces are whole repeats. Dims count from the end (-1 is the last), so they line
up across broadcasting operands. A recorded tag is trusted only while the tensor's version
counter is unchanged: any in-place write, through any view, drops it.
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

# dim (negative) -> (outer, period): read as [outer, n, period], the dim holds one value along n
Blocks = dict[int, tuple[int, int]]
WHOLE = (1, 1)


def broadcast_blocks(t: torch.Tensor) -> Blocks:
    """The dims (negative) along which ``t`` holds one value, as ``(outer, period)``: size 1,
    stride 0 or recorded whole ``(1, 1)``, or recorded in blocks or repeats."""
    tag = tensor_state.read(t, "broadcast")
    blocks = dict(tag[1]) if tag is not None and tag[0] == t._version else {}
    if t.layout is torch.strided:
        blocks.update((d - t.dim(), WHOLE) for d in range(t.dim())
                      if t.shape[d] == 1 or t.stride(d) == 0)
    return blocks


def broadcast_dims(t: torch.Tensor) -> frozenset[int]:
    """The dims (negative) along which ``t`` holds one value: size 1, stride 0, or recorded."""
    return frozenset(d for d, known in broadcast_blocks(t).items() if known == WHOLE)


def fits_shard(t: torch.Tensor, dim: int, outer: int = 1) -> bool:
    """Whether ``t`` is the local piece of a global broadcast along a shard of ``dim`` in
    ``outer`` blocks: it holds one value in each of a number of blocks dividing ``outer``, and
    repeats with a period that divides each of its ``outer`` pieces."""
    dim = dim - t.dim() if dim >= 0 else dim
    found = broadcast_blocks(t).get(dim)
    if found is None:
        return False
    blocks, period = found
    return outer % blocks == 0 and (t.shape[dim] // outer) % period == 0


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
    blocks.update((d, WHOLE) for d in range(-ndim, -x.dim()))
    return blocks


def _common(found: list[Blocks]) -> Blocks:
    """What every operand holds one value along: a whole broadcast fits any other kind."""
    common = {}
    for d in set.intersection(*(set(b) for b in found)):
        kinds = {b[d] for b in found} - {WHOLE}
        if len(kinds) <= 1:
            common[d] = kinds.pop() if kinds else WHOLE
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


def _spans(in_shape, dims: list[int], blocks: Blocks) -> list[tuple[int, int]]:
    """The ``(stride, count)`` runs of the dims ``dims`` flattened along which the value is
    one: a step of ``stride`` elements, taken up to ``count`` times, keeps the value."""
    spans: list[tuple[int, int]] = []
    inner = 1
    for d in reversed(dims):
        size, known = in_shape[d], blocks.get(d - len(in_shape))
        if known is not None and size // (known[0] * known[1]) > 1:
            stride, count = inner * known[1], size // (known[0] * known[1])
            if spans and spans[-1][0] * spans[-1][1] == stride:
                stride, count = spans[-1][0], spans[-1][1] * count
                spans.pop()
            spans.append((stride, count))
        inner *= size
    return spans


def _in_dim(inner: int, size: int, spans: list[tuple[int, int]]) -> tuple[int, int] | None:
    """What a dim of ``size`` whose step is ``inner`` flattened elements holds one value along,
    from the ``spans`` of its group (the widest part of one span it meets)."""
    best, found = 1, None
    for stride, count in spans:
        lo, hi = max(inner, stride), min(inner * size, stride * count)
        if (hi // lo > best and hi % lo == 0 and lo % inner == 0 and lo % stride == 0
                and (inner * size) % hi == 0 and (stride * count) % hi == 0):
            best, found = hi // lo, (inner * size // hi, lo // inner)
    return found


def _viewed(in_shape, out_shape, blocks: Blocks) -> Blocks:
    """A reshape's broadcast blocks from its input's."""
    result: Blocks = {}
    for ins, outs in _groups(tuple(in_shape), tuple(out_shape)) or ():
        spans = _spans(in_shape, ins, blocks)
        inner = 1
        for d in reversed(outs):
            known = _in_dim(inner, out_shape[d], spans) if spans else None
            if known is not None:
                result[d - len(out_shape)] = known
            inner *= out_shape[d]
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
    (``kind``: what :func:`op_kind` says of ``func``, not ""); the checker calls it for an
    expand, or where an operand has a tag (``tensor_state.any_set(args, "broadcast")``)."""
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
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
