"""Typing rules for aten ops: one table entry per op, looked up once per OpOverload.

A rule sees the checker context, the op's args/kwargs and its output, and returns the
result's placements: one tuple per mesh axis (``None`` on an axis means unknown), a list of
such tuples for ops with several outputs, or ``None`` when the result is unknown. A rule
raises :class:`Violation` when the op would compute a wrong global value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardcheck.types import I, P, Placement, R, S, Shard, V

aten = torch.ops.aten


class _PartialAverage(Placement):
    """A mean over one rank's shard: only an AVG all-reduce turns it into R."""

    __slots__ = ()
    symbol = "P(avg)"


class Gathered(Placement):
    """All-gathered along dim 0 from shards on ``dim``: rank blocks stacked on dim 0."""

    __slots__ = ("dim",)

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def __repr__(self) -> str:
        return f"G({self.dim})"


class RankChunk(Shard):
    """S(d) from the rank-slice heuristic on a split: this rank's chunk of an R tensor.

    It acts as S(d), except where the pieces of the split are put back together (cat,
    list collectives): there it is what it really holds on every rank, R.
    """

    __slots__ = ()


def as_pieces(pl: tuple) -> tuple:
    """Read rank chunks as the replicated pieces they are (for cat and list collectives)."""
    return tuple(R if type(p) is RankChunk else p for p in pl)


PAVG: Placement = _PartialAverage()
NO_TENSOR = ()  # a typed result without tensor outputs (e.g. ``.item()``)

Pl = tuple  # per-axis placements, None where unknown


class Violation(Exception):
    """A rule's verdict: ``rule`` broken on mesh axis ``axis`` (an index)."""

    def __init__(self, rule: str, axis: int, why: str = "") -> None:
        super().__init__(rule)
        self.rule, self.axis, self.why = rule, axis, why


HELP: dict[str, tuple[str, str]] = {
    "non-linear on partial": (
        "the op is not linear: applied to each rank's partial sum it differs from the op of the sum",
        "all_reduce over {axis} before {op}"),
    "affine on partial": (
        "adding a non-zero replicated/sharded value to a partial sum adds it once per rank",
        "all_reduce over {axis} first, or add the term on one rank only"),
    "partial product": (
        "a product of per-rank partial sums is not the product of the sums",
        "all_reduce over {axis} one of the operands first"),
    "division by partial": (
        "each rank divides by its own partial of the divisor, not by the global value",
        "all_reduce the divisor over {axis} before dividing"),
    "mean over shard": (
        "a mean over one rank's shard is a partial average: only an AVG all-reduce completes it",
        "sum over the shard and divide by the global count, or all_reduce(AVG) over {axis}"),
    "normalization over shard": (
        "the op normalises along a dim that is split over the ranks, using only the local part",
        "all_gather over {axis} first, or compute the statistics with collectives"),
    "global shape mismatch": (
        "a replicated full-size operand is combined with one rank's slice of a sharded one",
        "slice the replicated operand by rank (sc.rank_slice) or all_gather the sharded one over {axis}"),
    "mixed shards": (
        "the operands are split along different dims, so their local pieces do not line up",
        "redistribute one operand over {axis} so both are sharded on the same dim"),
    "double count": (
        "a SUM all-reduce of a replicated value adds n copies of the same value",
        "drop this all_reduce, or reduce the partial value instead"),
    "gather of replicated": (
        "all_gather of a replicated value concatenates n copies of it",
        "drop the all_gather over {axis}, or gather the sharded value"),
    "scatter of replicated": (
        "reduce_scatter of a replicated value sums n copies of it",
        "slice by rank instead (sc.rank_slice), or reduce-scatter the partial value"),
    "split of varying": (
        "the tensor already differs per rank, so taking this rank's chunk of it keeps only a "
        "fraction of each rank's data",
        "split the replicated value, or check which group's rank indexes the split"),
    "unknown axis": (
        "the collective runs on a group whose ranks match no axis of the mesh",
        "use the process group of the axis the data is laid out on"),
    "assertion": ("sc.assert_type found another type", "fix the program or the assertion"),
    "contract": ("an argument does not have the type the function's contract requires",
                 "convert the argument before the call"),
}


# --- helpers -------------------------------------------------------------------------------

def _arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any = None) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _is_partial(p: Placement | None) -> bool:
    return p is P or p is PAVG


def _replicated(p: Placement | None) -> bool:
    return p is R or p is I


def shift_shards(pl: Pl, moved: Callable[[int], int | None]) -> Pl:
    """Move each S(d) to S(moved(d)); None from ``moved`` makes that axis unknown."""
    out = []
    for p in pl:
        if isinstance(p, Shard):
            d = moved(p.dim)
            out.append(None if d is None else S(d))
        elif isinstance(p, Gathered):
            out.append(None)
        else:
            out.append(p)
    return tuple(out)


# --- elementwise ---------------------------------------------------------------------------
# An operand's role: ADD (linear, summed), MUL (linear, multiplied), DIV (a divisor),
# NL (any non-linear use).
ADD, MUL, DIV, NL = "add", "mul", "div", "nl"


class Typed:
    """An operand that is no tensor yet: its placements and shape (e.g. addmm's product)."""

    __slots__ = ("pl", "shape")

    def __init__(self, pl: Pl, shape: tuple) -> None:
        self.pl, self.shape = pl, shape


class _Operand:
    __slots__ = ("pl", "role", "zero", "shape", "scalar")

    def __init__(self, pl, role, zero, shape, scalar):
        self.pl, self.role, self.zero, self.shape, self.scalar = pl, role, zero, shape, scalar


def elementwise(ctx, items: list[tuple[Any, str]]) -> Pl | None:
    """Type an elementwise op over ``(value, role)`` items, broadcasting tensors."""
    ops = []
    out_ndim = 0
    for value, role in items:
        if _is_tensor(value):
            pl = ctx.types(value)
            if pl is None:
                if value.dim() != 0:
                    return None
                ops.append(_Operand(None, role, None, (), True))  # a constant of unknown value
                continue
            shape = value.shape
            out_ndim = max(out_ndim, len(shape))
            ops.append(_Operand(pl, role, ctx.zero(value), shape, False))
        elif isinstance(value, Typed):
            out_ndim = max(out_ndim, len(value.shape))
            ops.append(_Operand(value.pl, role, False, value.shape, False))
        elif value is not None:
            ops.append(_Operand(None, role, value == 0, (), True))
    result = []
    for a in range(ctx.n):
        result.append(_axis_elementwise(ops, a, out_ndim))
    return tuple(result)


def _axis_elementwise(ops: list[_Operand], a: int, out_ndim: int) -> Placement | None:
    tensors = [o for o in ops if not o.scalar]
    for o in tensors:
        p = o.pl[a]
        if p is None or isinstance(p, Gathered):
            return None
    partial = [o for o in tensors if _is_partial(o.pl[a]) and not o.zero]
    if partial:
        return _axis_partial(ops, partial, a)
    return _axis_layout(tensors, a, out_ndim)


def _axis_partial(ops: list[_Operand], partial: list[_Operand], a: int) -> Placement | None:
    kind = partial[0].pl[a]
    avg = kind is PAVG
    if any(o.pl[a] is not kind for o in partial):
        raise Violation("mean over shard", a)
    for o in partial:
        if o.role == NL:
            raise Violation("mean over shard" if avg else "non-linear on partial", a)
        if o.role == DIV:
            raise Violation("mean over shard" if avg else "division by partial", a)
    roles = {o.role for o in partial}
    varying = False
    for o in ops:
        if o in partial:
            continue
        if o.scalar:
            if o.role == ADD and o.zero is None:
                return None
            if o.role == ADD and not o.zero:
                raise Violation("mean over shard" if avg else "affine on partial", a)
            continue
        p = o.pl[a]
        if p is V:
            varying = True
        elif o.zero:
            continue
        elif MUL in roles or (o.role != ADD and ADD not in roles):
            if not _replicated(p):
                raise Violation("mean over shard" if avg else "partial product", a)
        elif o.role == ADD:
            raise Violation("mean over shard" if avg else "affine on partial", a)
        elif not _replicated(p):
            raise Violation("mean over shard" if avg else "affine on partial", a)
    if MUL in roles and len(partial) > 1:
        raise Violation("mean over shard" if avg else "partial product", a)
    return V if varying else kind


def _axis_layout(tensors: list[_Operand], a: int, out_ndim: int) -> Placement:
    shard_dims = set()
    varying, invariant_only = False, True
    for o in tensors:
        p = o.pl[a]
        if isinstance(p, Shard):
            shard_dims.add(_norm(p.dim, len(o.shape)) + out_ndim - len(o.shape))
        if p is V:
            varying = True
        if p is not I:
            invariant_only = False
    if len(shard_dims) > 1:
        raise Violation("mixed shards", a)
    if shard_dims:
        (d,) = shard_dims
        for o in tensors:
            if _replicated(o.pl[a]) or _is_partial(o.pl[a]):
                local = d - (out_ndim - len(o.shape))
                if local >= 0 and o.shape[local] != 1:
                    raise Violation("global shape mismatch", a)
        return V if varying else S(d)
    if varying:
        return V
    return I if invariant_only and tensors else R


def _roles(*roles: str) -> Callable:
    """A rule for an op whose leading positional args take the given roles."""
    def rule(ctx, args, kwargs, out):
        items = [(args[i] if i < len(args) else None, role) for i, role in enumerate(roles)]
        return elementwise(ctx, items)
    return rule


def _add_rule(ctx, args, kwargs, out):
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    other = args[1]
    if not _is_tensor(other):
        other = other * alpha
    return elementwise(ctx, [(args[0], ADD), (other, ADD)])


def _where_rule(ctx, args, kwargs, out):
    return elementwise(ctx, [(args[0], NL), (args[1], ADD), (args[2], ADD)])


def _masked_fill_rule(ctx, args, kwargs, out):
    return elementwise(ctx, [(args[0], ADD), (args[1], NL), (args[2], ADD)])


def _unary_linear(ctx, args, kwargs, out):
    pl = ctx.types(args[0])
    if pl is None:
        return None
    return tuple(None if isinstance(p, Gathered) else p for p in pl)


def _unary_nonlinear(ctx, args, kwargs, out):
    pl = ctx.types(args[0])
    if pl is None:
        return None
    for a, p in enumerate(pl):
        if p is P:
            raise Violation("non-linear on partial", a)
        if p is PAVG:
            raise Violation("mean over shard", a)
    return pl


def _without_partial(pl: Pl | None) -> Pl | None:
    return None if pl is None else tuple(R if _is_partial(p) else p for p in pl)


def _keep_layout(ctx, args, kwargs, out):
    """Random fills keep their template's layout (the RNG is assumed in sync); else V."""
    pl = ctx.types(args[0]) if args and _is_tensor(args[0]) else None
    return (V,) * ctx.n if pl is None else _without_partial(pl)


def _dropout_rule(ctx, args, kwargs, out):
    pl = ctx.types(args[0])
    return None if pl is None else [pl, _without_partial(pl)]


# --- reductions ----------------------------------------------------------------------------

def _reduced_dims(dim: Any, ndim: int) -> set[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    return {_norm(d, max(ndim, 1)) for d in dim}


def reduction(kind: str, dim_pos: int = 1, keep_pos: int = 2) -> Callable:
    """sum-like (kind 'sum'), mean ('mean'), max-like ('max') or non-linear ('norm') reductions."""
    def rule(ctx, args, kwargs, out):
        x = args[0]
        pl = ctx.types(x)
        if pl is None:
            return None
        ndim = x.dim()
        dims = _reduced_dims(_arg(args, kwargs, dim_pos, "dim"), ndim)
        keep = bool(_arg(args, kwargs, keep_pos, "keepdim", False))
        result = tuple(_reduce_axis(kind, p, a, dims, keep, ndim) for a, p in enumerate(pl))
        return result
    return rule


def _reduce_axis(kind: str, p: Placement | None, a: int, dims: set[int], keep: bool, ndim: int):
    if p is None or isinstance(p, Gathered):
        return None
    if _is_partial(p):
        if kind in ("sum", "mean"):
            return p
        raise Violation("mean over shard" if p is PAVG else "non-linear on partial", a)
    if not isinstance(p, Shard):
        return p
    p = S(_norm(p.dim, max(ndim, 1)))  # S(-1) and S(ndim-1) are the same shard
    if p.dim in dims:
        if kind == "sum":
            return P
        if kind == "mean":
            return PAVG
        if kind == "max":
            return V
        raise Violation("normalization over shard", a)
    return p if keep else S(p.dim - sum(1 for d in dims if d < p.dim))


def _normalize_rule(ctx, args, kwargs, out):
    """softmax / log_softmax over ``dim``."""
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    dim = _norm(args[1], x.dim())
    for a, p in enumerate(pl):
        if p is P:
            raise Violation("non-linear on partial", a)
        if p is PAVG:
            raise Violation("mean over shard", a)
        if isinstance(p, Shard) and _norm(p.dim, x.dim()) == dim:
            raise Violation("normalization over shard", a)
    return pl


def _normalize_backward_rule(ctx, args, kwargs, out):
    """_softmax_backward_data / _log_softmax_backward_data(grad, output, dim, dtype)."""
    _normalize_rule(ctx, (args[1], args[2]), {}, out)
    return elementwise(ctx, [(args[0], MUL), (args[1], NL)])


def _layer_norm_rule(ctx, args, kwargs, out):
    """native_layer_norm(input, normalized_shape, weight, bias, eps) -> (out, mean, rstd)."""
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    first = x.dim() - len(args[1])
    for a, p in enumerate(pl):
        if _is_partial(p):
            raise Violation("mean over shard" if p is PAVG else "non-linear on partial", a)
        if isinstance(p, Shard) and _norm(p.dim, x.dim()) >= first:
            raise Violation("normalization over shard", a)
    weight, bias = _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias")
    return [elementwise(ctx, [(x, NL), (weight, NL), (bias, NL)]), pl, pl]


def _join(a: Pl | None, b: Pl | None) -> Pl | None:
    if a is None or b is None:
        return None
    return tuple(x if x == y else None for x, y in zip(a, b, strict=True))


def _layer_norm_backward_rule(ctx, args, kwargs, out):
    """native_layer_norm_backward(grad, input, shape, mean, rstd, weight, bias, mask)."""
    grad, x = args[0], args[1]
    g = elementwise(ctx, [(grad, MUL), (x, NL)])
    if g is None:
        return None
    lead = set(range(x.dim() - len(args[2])))
    param = tuple(_reduce_axis("sum", p, a, lead, False, x.dim()) for a, p in enumerate(g))
    return [g, param, param]


def _activation_backward(ctx, args, kwargs, out):
    """gelu_backward(grad, self), silu_backward, threshold_backward, ...: linear in grad."""
    return elementwise(ctx, [(args[0], MUL), (args[1], NL)])


def _dropout_backward(ctx, args, kwargs, out):
    return elementwise(ctx, [(args[0], MUL), (args[1], MUL)])


# --- contractions --------------------------------------------------------------------------

def einsum_rule(ctx, specs: list[tuple[Any, str]], out_spec: str) -> Pl | None:
    """Type a contraction given each operand's dim letters and the output's letters."""
    pls = []
    for t, letters in specs:
        pl = ctx.types(t)
        if pl is None:
            return None
        pls.append((pl, letters))
    return tuple(_axis_contract(pls, a, out_spec) for a in range(ctx.n))


def _axis_contract(pls, a: int, out_spec: str) -> Placement | None:
    ps = [pl[a] for pl, _ in pls]
    if any(p is None or isinstance(p, Gathered) for p in ps):
        return None
    partial = [p for p in ps if _is_partial(p)]
    if partial:
        if PAVG in partial:
            raise Violation("mean over shard", a)
        if len(partial) > 1 or any(isinstance(p, Shard) for p in ps):
            raise Violation("partial product", a)
        return V if V in ps else P
    letters = set()
    for p, (_, spec) in zip(ps, pls, strict=True):
        if isinstance(p, Shard):
            letters.add(spec[_norm(p.dim, len(spec))])
    if len(letters) > 1:
        raise Violation("mixed shards", a)
    if V in ps:
        return V
    if not letters:
        return I if all(p is I for p in ps) else R
    (letter,) = letters
    for p, (_, spec) in zip(ps, pls, strict=True):
        if _replicated(p) and letter in spec:
            raise Violation("global shape mismatch", a)
    return S(out_spec.index(letter)) if letter in out_spec else P


def _mm(ctx, args, kwargs, out):
    return einsum_rule(ctx, [(args[0], "nk"), (args[1], "km")], "nm")


def _bmm(ctx, args, kwargs, out):
    return einsum_rule(ctx, [(args[0], "bnk"), (args[1], "bkm")], "bnm")


def _mv(ctx, args, kwargs, out):
    return einsum_rule(ctx, [(args[0], "nk"), (args[1], "k")], "n")


def _dot(ctx, args, kwargs, out):
    return einsum_rule(ctx, [(args[0], "k"), (args[1], "k")], "")


def _with_bias(contract: Callable) -> Callable:
    """addmm/baddbmm(bias, a, b, beta, alpha): the product plus a broadcast bias."""
    def rule(ctx, args, kwargs, out):
        prod = contract(ctx, args[1:3], kwargs, out)
        if prod is None:
            return None
        if kwargs.get("beta", args[3] if len(args) > 3 else 1) == 0:
            return prod  # beta=0: the bias is ignored (an uninitialised buffer, typically)
        return elementwise(ctx, [(args[0], ADD), (Typed(prod, tuple(out.shape)), ADD)])
    return rule


def _embedding_rule(ctx, args, kwargs, out):
    """embedding(weight, indices): a vocab-sharded weight yields a partial (masked) lookup."""
    weight, idx = args[0], args[1]
    wl, il = ctx.types(weight), ctx.types(idx)
    if wl is None or il is None:
        return None
    result = []
    for a, (w, i) in enumerate(zip(wl, il, strict=True)):
        if w is None or i is None:
            result.append(None)
        elif _is_partial(i):
            raise Violation("non-linear on partial", a)
        elif w is V or i is V:
            result.append(V)
        elif isinstance(w, Shard) and isinstance(i, Shard):
            raise Violation("mixed shards", a)
        elif isinstance(w, Shard):
            result.append(P if _norm(w.dim, 2) == 0 else S(idx.dim()))
        elif isinstance(i, Shard):
            result.append(i)
        else:
            result.append(w)
    return tuple(result)


def _embedding_backward_rule(ctx, args, kwargs, out):
    """embedding_dense_backward(grad, indices, num_weights, padding_idx, scale)."""
    grad = args[0]
    pl = ctx.types(grad)
    if pl is None:
        return None
    last = grad.dim() - 1
    tokens = set(range(last))
    return tuple(S(1) if isinstance(p, Shard) and _norm(p.dim, grad.dim()) == last
                 else _reduce_axis("sum", p, a, tokens, False, grad.dim()) for a, p in enumerate(pl))


def _nll_rule(ctx, args, kwargs, out):
    """nll_loss_forward(self, target, weight, reduction, ignore_index) -> (loss, total_weight)."""
    x, target = args[0], args[1]
    xl, tl = ctx.types(x), ctx.types(target)
    if xl is None or tl is None:
        return None
    reduction = _arg(args, kwargs, 3, "reduction", 1)
    class_dim = 1 if x.dim() > 1 else 0
    loss, weight = [], []
    for a, (p, t) in enumerate(zip(xl, tl, strict=True)):
        if p is None or t is None:
            loss.append(None)
            weight.append(None)
            continue
        if isinstance(p, Shard) and _norm(p.dim, x.dim()) == class_dim:
            raise Violation("normalization over shard", a)
        if p is PAVG:
            raise Violation("mean over shard", a)
        lay = p if not _replicated(p) else t
        if _is_partial(t):
            raise Violation("non-linear on partial", a)
        loss.append(_nll_reduce(lay, reduction))
        weight.append(_nll_reduce(t, 2) if isinstance(t, Shard) else (V if t is V else R))
    return [tuple(loss), tuple(weight)]


def _nll_reduce(p: Placement, reduction: int) -> Placement:
    if isinstance(p, Shard) and reduction != 0:
        return P if reduction == 2 else PAVG
    return p


def _nll_backward_rule(ctx, args, kwargs, out):
    """nll_loss_backward(grad, self, target, weight, reduction, ignore_index, total_weight)."""
    gl, xl = ctx.types(args[0]), ctx.types(args[1])
    if gl is None or xl is None:
        return None
    result = []
    for g, x in zip(gl, xl, strict=True):
        if g is None or x is None:
            result.append(None)
        else:
            result.append(g if g is P or g is V else x)
    return tuple(result)


# --- shape ops -----------------------------------------------------------------------------

def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def view_dim(in_shape, out_shape, d: int) -> int | None:
    """Where a shard on input dim ``d`` lands after a reshape, or None when it cannot."""
    pre = _prod(in_shape[:d])
    candidates = [j for j in range(len(out_shape)) if _prod(out_shape[:j]) == pre]
    if not candidates:
        return None
    for j in candidates:
        if out_shape[j] == in_shape[d]:
            return j
    for j in candidates:
        if out_shape[j] > 1:
            return j
    return candidates[0]


def _view_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    in_shape, out_shape = tuple(x.shape), tuple(out.shape)
    return shift_shards(pl, lambda d: view_dim(in_shape, out_shape, _norm(d, len(in_shape))))


def _permute_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    ndim = x.dim()
    order = [_norm(d, ndim) for d in args[1]]
    return shift_shards(pl, lambda d: order.index(_norm(d, ndim)))


def _transpose_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    ndim = x.dim()
    if len(args) < 3:  # t()
        d0, d1 = 0, max(ndim - 1, 0)
    else:
        d0, d1 = _norm(args[1], ndim), _norm(args[2], ndim)
    swap = {d0: d1, d1: d0}
    return shift_shards(pl, lambda d: swap.get(_norm(d, ndim), _norm(d, ndim)))


def _unsqueeze_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    new = _norm(args[1], x.dim() + 1)
    return shift_shards(pl, lambda d: _norm(d, x.dim()) + (_norm(d, x.dim()) >= new))


def _squeeze_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    ndim = x.dim()
    dims = args[1] if len(args) > 1 else range(ndim)
    dims = [dims] if isinstance(dims, int) else dims
    gone = {_norm(d, ndim) for d in dims if x.shape[_norm(d, ndim)] == 1}

    def moved(d: int) -> int | None:
        d = _norm(d, ndim)
        return None if d in gone else d - sum(1 for g in gone if g < d)
    return shift_shards(pl, moved)


def _expand_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    lead = out.dim() - x.dim()
    return shift_shards(pl, lambda d: _norm(d, x.dim()) + lead)


def _cut_along(ctx, pl: Pl, ndim: int, dim: int, pieces: list[tuple[int, int]], total: int,
               by_rank_slice: bool = False) -> list[Pl]:
    """Placements of each piece (start, length) cut from a tensor along ``dim``.

    Cutting along a sharded dim gives V. The rank-slice heuristic: a piece of an R tensor
    whose length is total / axis size and whose start is this rank's index on that axis
    times the length is S(dim) on that axis (Megatron's scatter-to-region idiom). A slice
    (``by_rank_slice``) of a V tensor matching the pattern is a "split of varying".
    """
    results = []
    for start, length in pieces:
        by_rank = rank_piece(ctx, pl, dim, total, start, length, by_rank_slice)
        per_axis = []
        for a, p in enumerate(pl):
            if a in by_rank:
                per_axis.append(by_rank[a])
            elif isinstance(p, Shard) and _norm(p.dim, ndim) == dim:
                per_axis.append(V)
            elif isinstance(p, Gathered):
                per_axis.append(R if dim == 0 else None)
            else:
                per_axis.append(p)
        results.append(tuple(per_axis))
    return results


def rank_piece(ctx, pl: Pl, dim: int, total: int, start: int, length: int,
               check_varying: bool) -> dict[int, Placement | None]:
    """Axes on which the piece [start, start+length) is this rank's chunk of ``total``."""
    def matches(a: int) -> bool:
        size = ctx.sizes[a]
        return size > 1 and length * size == total and start == ctx.index[a] * length
    replicated = [a for a, p in enumerate(pl) if _replicated(p) and matches(a)]
    if len(replicated) == 1:
        return {replicated[0]: S(dim) if check_varying else RankChunk(dim)}
    if replicated:  # ambiguous: several axes have the same size and index here
        return dict.fromkeys(replicated)
    if check_varying:
        for a, p in enumerate(pl):
            if p is V and matches(a):
                raise Violation("split of varying", a)
    return {}


def _slice_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    ndim = x.dim()
    dim = _norm(_arg(args, kwargs, 1, "dim", 0), ndim)
    size = x.shape[dim]
    start = _arg(args, kwargs, 2, "start", 0) or 0
    step = _arg(args, kwargs, 4, "step", 1)
    start = max(0, min(size, _norm(start, size)))
    length = out.shape[dim]
    if step != 1:
        start = -1  # a strided slice is no rank's chunk
    return _cut_along(ctx, pl, ndim, dim, [(start, length)], size, by_rank_slice=True)[0]


def _select_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    ndim = x.dim()
    dim = _norm(args[1], ndim)
    index = _norm(args[2], x.shape[dim])
    (piece,) = _cut_along(ctx, pl, ndim, dim, [(index, 1)], x.shape[dim], by_rank_slice=True)
    return shift_shards(piece, lambda d: None if d == dim else d - (d > dim))


def _split_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    ndim = x.dim()
    dim = _norm(_arg(args, kwargs, 2, "dim", 0), ndim)
    pieces, start = [], 0
    for t in out:
        pieces.append((start, t.shape[dim]))
        start += t.shape[dim]
    return _cut_along(ctx, pl, ndim, dim, pieces, x.shape[dim])


def _unbind_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    ndim = x.dim()
    dim = _norm(_arg(args, kwargs, 1, "dim", 0), ndim)
    pieces = _cut_along(ctx, pl, ndim, dim, [(k, 1) for k in range(len(out))], len(out))
    return [shift_shards(p, lambda d: None if d == dim else d - (d > dim)) for p in pieces]


def _pieces(ctx, tensors) -> list:
    """Operands put back together: rank chunks read as R when other pieces are there."""
    if len(tensors) < 2:
        return [(t, ADD) for t in tensors]
    items = []
    for t in tensors:
        pl = ctx.types(t)
        items.append((Typed(as_pieces(pl), tuple(t.shape)) if pl is not None else t, ADD))
    return items


def _cat_rule(ctx, args, kwargs, out):
    tensors = [t for t in args[0] if t.numel() > 0 or t.dim() > 1]
    if not tensors:
        return None
    ndim = out.dim()
    dim = _norm(_arg(args, kwargs, 1, "dim", 0), ndim)
    pl = elementwise(ctx, _pieces(ctx, tensors))
    if pl is None:
        return None
    return tuple(V if isinstance(p, Shard) and p.dim == dim and len(tensors) > 1 else p
                 for p in pl)


def _stack_rule(ctx, args, kwargs, out):
    ndim = out.dim()
    dim = _norm(_arg(args, kwargs, 1, "dim", 0), ndim)
    pl = elementwise(ctx, _pieces(ctx, args[0]))
    if pl is None:
        return None
    return shift_shards(pl, lambda d: d + (d >= dim))


def _along_dim_rule(self_pos: int, dim_pos: int, index_pos: int) -> Callable:
    """index_select / gather / scatter: typed when the indexed dim is not sharded."""
    def rule(ctx, args, kwargs, out):
        x = args[self_pos]
        pl = ctx.types(x)
        il = ctx.types(args[index_pos])
        if pl is None or il is None:
            return None
        dim = _norm(args[dim_pos], x.dim())
        result = []
        for a, (p, i) in enumerate(zip(pl, il, strict=True)):
            if p is None or i is None or isinstance(p, Gathered):
                result.append(None)
            elif _is_partial(i):
                raise Violation("non-linear on partial", a)
            elif isinstance(p, Shard) and _norm(p.dim, x.dim()) == dim:
                result.append(V)
            elif i is V:
                result.append(V)
            else:
                result.append(p)
        return tuple(result)
    return rule


def _scatter_rule(ctx, args, kwargs, out):
    base = _along_dim_rule(0, 1, 2)(ctx, args, kwargs, out)
    src = args[3] if len(args) > 3 else kwargs.get("src", kwargs.get("value"))
    if base is None or not _is_tensor(src):
        return base
    return _join(base, ctx.types(src))


def _index_rule(ctx, args, kwargs, out):
    """x[idx] with index tensors. Per axis: a shard indexed along its sharded dim reads each
    rank's own slice at the same local indices (V); other shards become unknown; a replicated
    x takes the layout of the indices (all replicated: x's own; one leading index tensor:
    its S(d) or V, since the index dims lead the result); anything else is unknown."""
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    typed = [(d, ctx.types(idx)) for d, idx in enumerate(args[1]) if idx is not None]
    if any(t is None for _, t in typed):
        return None
    indexed, ndim = {d for d, _ in typed}, x.dim()
    single_leading = len(typed) == 1 and typed[0][0] == 0
    result = []
    for a, p in enumerate(pl):
        index_pl = [t[a] for _, t in typed]
        if isinstance(p, Shard) and _norm(p.dim, ndim) in indexed:
            result.append(V)
        elif p is None or isinstance(p, (Shard, Gathered)):
            result.append(None)
        elif all(_replicated(q) for q in index_pl):
            result.append(p)
        elif _replicated(p) and single_leading and (index_pl[0] is V or isinstance(index_pl[0], Shard)):
            result.append(index_pl[0])
        else:
            result.append(None)
    return tuple(result)


def _index_put_rule(ctx, args, kwargs, out):
    """x[idx] = values: the stored values must have x's placement (zeros fit a partial)."""
    xl, values = ctx.types(args[0]), args[2]
    if xl is None:
        return None
    scalar_types = ctx.types(values)
    if values.dim() == 0 and (scalar_types is None or all(_replicated(p) for p in scalar_types)):
        # one value written everywhere (a Python number or a replicated scalar)
        if all(not _is_partial(p) for p in xl) or values.item() == 0:
            return xl
        return tuple(None if _is_partial(p) else p for p in xl)
    return _join(xl, ctx.types(values))


def _copy_rule(ctx, args, kwargs, out):
    dst, src = args[0], args[1]
    pl = ctx.types(src)
    if pl is None:
        return None
    lead = dst.dim() - src.dim()
    return shift_shards(pl, lambda d: _norm(d, src.dim()) + lead)


def _fill_rule(ctx, args, kwargs, out):
    value = args[1]
    if _is_tensor(value):
        return ctx.types(value)
    return (R,) * ctx.n


def _flip_like(dims_pos: int) -> Callable:
    """flip/roll/repeat: reordering or repeating a sharded dim loses its meaning (V)."""
    def rule(ctx, args, kwargs, out):
        x = args[0]
        pl = ctx.types(x)
        if pl is None:
            return None
        dims = _arg(args, kwargs, dims_pos, "dims", None)
        touched = _reduced_dims(dims, x.dim())
        return tuple(V if isinstance(p, Shard) and _norm(p.dim, x.dim()) in touched else p
                     for p in pl)
    return rule


def _repeat_rule(ctx, args, kwargs, out):
    x = args[0]
    pl = ctx.types(x)
    if pl is None:
        return None
    reps = list(args[1])
    lead = len(reps) - x.dim()
    result = []
    for p in pl:
        if isinstance(p, Shard):
            d = _norm(p.dim, x.dim()) + lead
            result.append(V if reps[d] != 1 else S(d))
        else:
            result.append(None if isinstance(p, Gathered) else p)
    return tuple(result)


def _replicated_rule(ctx, args, kwargs, out):
    return (R,) * ctx.n


def _like_rule(ctx, args, kwargs, out):
    """zeros_like(x) & co: a fresh value with x's local shape, so a shard of x gives a shard
    (the same value on every rank, cut the same way); everything else is replicated."""
    pl = ctx.types(args[0])
    if pl is None:
        return (R,) * ctx.n
    return tuple(S(_norm(p.dim, args[0].dim())) if isinstance(p, Shard) else R for p in pl)


def _varying_rule(ctx, args, kwargs, out):
    return (V,) * ctx.n


def _scalar_rule(ctx, args, kwargs, out):
    return NO_TENSOR


# --- the table -----------------------------------------------------------------------------

NONLINEAR_UNARY = [
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "relu", "gelu", "silu", "sigmoid",
    "tanh", "sqrt", "rsqrt", "abs", "erf", "erfinv", "sin", "cos", "reciprocal", "sign", "sgn",
    "floor", "ceil", "round", "trunc", "frac", "isnan", "isinf", "isfinite", "logical_not",
    "hardtanh", "leaky_relu", "elu", "softplus", "mish", "hardswish", "hardsigmoid",
    "nan_to_num", "bitwise_not", "logit", "relu6", "square", "threshold",
    "clamp", "clamp_min", "clamp_max", "pow", "tril", "triu", "any", "all", "sort", "topk",
    "cumsum", "cumprod",
]
NONLINEAR_BINARY = [
    "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "atan2", "fmod", "remainder",
    "floor_divide", "fmax", "fmin", "xlogy", "hypot",
]
LINEAR_UNARY = [
    "neg", "clone", "detach", "alias", "_to_copy", "contiguous", "positive", "conj",
    "resolve_conj", "resolve_neg", "_conj", "lift_fresh_copy", "to", "_unsafe_view_copy",
    "view_as", "type_as", "float", "half", "bfloat16", "double", "real",
]
ACTIVATION_BACKWARD = [
    "gelu_backward", "silu_backward", "threshold_backward", "sigmoid_backward", "tanh_backward",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
    "mish_backward", "hardswish_backward",
]
FACTORIES = [
    "zeros", "ones", "full", "empty", "empty_strided", "arange", "eye", "scalar_tensor",
    "linspace", "logspace", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros",
    "new_ones", "new_full", "new_empty", "new_empty_strided", "lift_fresh", "tensor",
]
LIKE_FACTORIES = ["zeros_like", "ones_like", "full_like", "empty_like"]
RANDOM_FACTORIES = ["rand", "randn", "randint", "randperm"]
RANDOM_FROM_TEMPLATE = [
    "rand_like", "randn_like", "randint_like", "bernoulli", "uniform", "normal", "random",
    "exponential", "cauchy", "log_normal", "geometric",
]
ZERO_MAKERS = {"zeros", "zeros_like", "new_zeros", "zero"}
FILL_OPS = {"full", "full_like", "new_full", "fill", "scalar_tensor"}  # zero when the value is 0

_reduce = {
    "sum": reduction("sum"), "nansum": reduction("sum"), "mean": reduction("mean"),
    "nanmean": reduction("mean"), "amax": reduction("max"), "amin": reduction("max"),
    "max": reduction("max"), "min": reduction("max"), "argmax": reduction("max"),
    "argmin": reduction("max"), "prod": reduction("norm"), "logsumexp": reduction("norm"),
    "linalg_vector_norm": reduction("norm", 2, 3), "norm": reduction("norm"),
    "var": reduction("norm"), "std": reduction("norm"), "var_mean": reduction("norm"),
    "std_mean": reduction("norm"),
}


def _base_table() -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    table.update(dict.fromkeys(NONLINEAR_UNARY, _roles(NL, NL)))
    table.update(dict.fromkeys(NONLINEAR_BINARY, _roles(NL, NL)))
    table.update(dict.fromkeys(LINEAR_UNARY, _unary_linear))
    table.update(dict.fromkeys(ACTIVATION_BACKWARD, _activation_backward))
    table.update(dict.fromkeys(FACTORIES, _replicated_rule))
    table.update(dict.fromkeys(LIKE_FACTORIES, _like_rule))
    table.update(dict.fromkeys(RANDOM_FACTORIES, _varying_rule))
    table.update(dict.fromkeys(RANDOM_FROM_TEMPLATE, _keep_layout))
    table.update(_reduce)
    table.update({
        "add": _add_rule, "sub": _add_rule, "rsub": _add_rule,
        "mul": _roles(MUL, MUL), "div": _roles(MUL, DIV), "true_divide": _roles(MUL, DIV),
        "where": _where_rule, "masked_fill": _masked_fill_rule, "lerp": _roles(NL, NL, NL),
        "addcmul": _roles(ADD, MUL, MUL), "addcdiv": _roles(ADD, MUL, DIV),
        "zero": _replicated_rule, "fill": _fill_rule, "copy": _copy_rule,
        "native_dropout": _dropout_rule, "native_dropout_backward": _dropout_backward,
        "_softmax": _normalize_rule, "_log_softmax": _normalize_rule,
        "softmax": _normalize_rule, "log_softmax": _normalize_rule,
        "_softmax_backward_data": _normalize_backward_rule,
        "_log_softmax_backward_data": _normalize_backward_rule,
        "native_layer_norm": _layer_norm_rule,
        "native_layer_norm_backward": _layer_norm_backward_rule,
        "mm": _mm, "bmm": _bmm, "mv": _mv, "dot": _dot,
        "addmm": _with_bias(_mm), "baddbmm": _with_bias(_bmm),
        "embedding": _embedding_rule, "embedding_dense_backward": _embedding_backward_rule,
        "nll_loss_forward": _nll_rule, "nll_loss_backward": _nll_backward_rule,
        "view": _view_rule, "_unsafe_view": _view_rule, "reshape": _view_rule,
        "_reshape_alias": _view_rule,
        "permute": _permute_rule, "transpose": _transpose_rule, "t": _transpose_rule,
        "unsqueeze": _unsqueeze_rule, "squeeze": _squeeze_rule, "expand": _expand_rule,
        "slice": _slice_rule, "select": _select_rule, "split": _split_rule,
        "split_with_sizes": _split_rule, "unbind": _unbind_rule,
        "cat": _cat_rule, "stack": _stack_rule,
        "index_select": _along_dim_rule(0, 1, 2), "gather": _along_dim_rule(0, 1, 2),
        "scatter": _scatter_rule, "scatter_add": _scatter_rule,
        "index": _index_rule, "index_put": _index_put_rule,
        "flip": _flip_like(1), "roll": _flip_like(2), "repeat": _repeat_rule,
        "_local_scalar_dense": _scalar_rule, "sym_size": _scalar_rule,
        "sym_numel": _scalar_rule, "equal": _scalar_rule, "is_nonzero": _scalar_rule,
    })
    return table


RULES: dict[str, Callable] = _base_table()
"""Rule per op base name ("add" covers add.Tensor, add_.Scalar, add.out, ...)."""
