"""Typing rules for aten ops: one table entry per op, looked up once per OpOverload.

A rule sees the checker context, the op's args/kwargs and its output, and returns the
result's placements: one tuple per mesh axis (``None`` on an axis means unknown), a list of
such tuples for ops with several outputs, or ``None`` when the result is unknown. A rule
raises :class:`Violation` when the op would compute a wrong global value.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.broadcast import fits_shard
from shardcheck.typecheck.rules.common import (
    NO_TENSOR,
    RuleContext,
    arg,
    is_partial,
    is_tensor,
    moved,
    nested_outside,
    norm_dim,
    on_typed_operand,
    outer_of,
    replicated,
)
from shardcheck.typecheck.types import (
    PAVG,
    PEVEN,
    BlockShard,
    Gathered,
    I,
    P,
    Pl,
    Placement,
    R,
    RankChunk,
    Routed,
    S,
    SectionShard,
    Shard,
    V,
)
from shardcheck.typecheck.violations import Violation

aten = torch.ops.aten


# --- elementwise ---------------------------------------------------------------------------
# An operand's role: ADD (linear, summed), MUL (linear, multiplied), DIV (a divisor),
# NL (any non-linear use).
ADD, MUL, DIV, NL = "add", "mul", "div", "nl"


class Typed:
    """An operand that is no tensor yet: its placements and shape (e.g. addmm's product),
    whether every element is known to be equal, and the tensor it stands for, if any (a piece
    of a cat, retyped: its broadcast dims are still the tensor's)."""

    __slots__ = ("pl", "shape", "const", "tensor")

    def __init__(self, pl: Pl, shape: tuple, const: bool = False,
                 tensor: torch.Tensor | None = None) -> None:
        self.pl, self.shape, self.const, self.tensor = pl, shape, const, tensor


class _Operand:
    __slots__ = ("pl", "role", "zero", "shape", "scalar", "const", "tensor")

    def __init__(self, pl, role, zero, shape, scalar, const=False, tensor=None):
        self.pl, self.role, self.zero, self.shape, self.scalar = pl, role, zero, shape, scalar
        self.const, self.tensor = const, tensor

    def broadcast_on(self, dim: int, outer: int = 1) -> bool:
        """Whether the operand holds one value along ``dim`` (in each of ``outer`` blocks; see
        shardcheck.typecheck.broadcast), as the gradient of a sum over ``dim`` does."""
        if self.shape[dim] == 1:
            return True
        return self.tensor is not None and fits_shard(self.tensor, dim - len(self.shape), outer)


def elementwise(ctx: RuleContext, items: list[tuple[Any, str]]) -> Pl | None:
    """Type an elementwise op over ``(value, role)`` items, broadcasting tensors."""
    fast = _same_simple_layout(ctx, items)
    if fast is not None:
        return fast
    ops = []
    out_ndim = 0
    for value, role in items:
        if is_tensor(value):
            pl = ctx.types(value)
            if pl is None:
                if not ctx.unseen_scalar(value):
                    return None
                ops.append(_Operand(None, role, None, (), True))  # a constant of unknown value
                continue
            shape = value.shape
            out_ndim = max(out_ndim, len(shape))
            ops.append(_Operand(pl, role, ctx.zero(value), shape, False, ctx.const(value),
                                value))
        elif isinstance(value, Typed):
            out_ndim = max(out_ndim, len(value.shape))
            ops.append(_Operand(value.pl, role, False, value.shape, False, value.const,
                                value.tensor))
        elif value is not None:
            ops.append(_Operand(None, role, value == 0, (), True))
    if all(o.pl is None for o in ops) and any(is_tensor(v) for v, _ in items):
        return None  # only untyped 0-dim tensors and numbers: nothing is known of the result
    return tuple(_axis_elementwise(ops, a, out_ndim) for a in range(ctx.n))


def _same_simple_layout(ctx: RuleContext, items: list[tuple[Any, str]]) -> Pl | None:
    """The common case, fast: every typed operand has the same placements, no P, and any
    shard is on tensors of equal rank. Returns None when the general rule must decide."""
    if ctx.rerun:  # its types are not the tensors' own: the general rule reads them
        return None
    first = None
    ndim = -1
    key = ctx.key
    for value, _ in items:
        if not isinstance(value, torch.Tensor):
            if isinstance(value, Typed):
                return None
            continue
        st = tensor_state.type_of(value)  # ctx.types(value), inlined: it runs at every op
        if st is None or st[0] is not key:
            return None
        pl = st[1]
        if first is None:
            first, ndim = pl, value.dim()
            for p in pl:
                if p is not R and p is not V and p is not I and type(p) is not Shard:
                    return None
        elif pl != first or value.dim() != ndim:
            return None
    return first


def _axis_elementwise(ops: list[_Operand], a: int, out_ndim: int) -> Placement | None:
    tensors = [o for o in ops if not o.scalar]
    for o in tensors:
        p = o.pl[a]
        if p is None or isinstance(p, Gathered):
            return None
    partial = [o for o in tensors if is_partial(o.pl[a]) and not o.zero]
    if partial:
        return _axis_partial(ops, partial, a, out_ndim)
    return _axis_layout(tensors, a, out_ndim)


def _axis_partial(ops: list[_Operand], partial: list[_Operand], a: int,
                  out_ndim: int) -> Placement | None:
    kind = _partial_kind(partial, a)
    avg = kind is PAVG
    for o in partial:
        if o.role == NL:
            raise Violation("mean over shard" if avg else "non-linear on partial", a)
    divisors = [o for o in partial if o.role == DIV]
    if divisors:
        return _even_quotient(ops, divisors, a, out_ndim)
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
            if not replicated(p):
                raise Violation("mean over shard" if avg else "partial product", a)
        elif o.role == ADD:
            raise Violation("mean over shard" if avg else "affine on partial", a)
        elif not replicated(p):
            raise Violation("mean over shard" if avg else "affine on partial", a)
    if MUL in roles and len(partial) > 1:
        raise Violation("mean over shard" if avg else "partial product", a)
    return V if varying else kind


def _partial_kind(partial: list[_Operand], a: int) -> Placement:
    """P(avg) when every partial operand is one (mixed with sums: a violation), P(even) when
    every one is P(even), else P."""
    kinds = {o.pl[a] for o in partial}
    if PAVG in kinds:
        if len(kinds) > 1:
            raise Violation("mean over shard", a)
        return PAVG
    return PEVEN if kinds == {PEVEN} else P


def _even_quotient(ops: list[_Operand], divisors: list[_Operand], a: int,
                   out_ndim: int) -> Placement | None:
    """Division by an even partial c = C/n: x_r / c = n x_r / C on every rank. A P numerator
    gives a P(avg) (the mean over ranks is X/C: a mean over equal shards), a P(even) one gives
    R (the n cancels). In a backward pass an R gradient gives R: gradients of a P(avg) loss
    carry the factor n that the gradient average takes out (as in mean's backward, which
    divides by the local count). Anything else divided by a partial is wrong on every rank.
    An untyped numerator leaves the result unknown."""
    divisor = divisors[0]
    if len(divisors) > 1 or divisor.pl[a] is not PEVEN:
        raise Violation("mean over shard" if divisor.pl[a] is PAVG else "division by partial", a)
    if any(o.scalar and o.zero is None for o in ops):
        return None
    plain = _Operand(divisor.pl[:a] + (R,) + divisor.pl[a + 1:], MUL, divisor.zero,
                     divisor.shape, divisor.scalar, divisor.const)
    rest = [plain if o is divisor else o for o in ops]
    numerator = _axis_elementwise(rest, a, out_ndim)
    if numerator is P:
        return PAVG
    if numerator is PEVEN:
        return R
    if numerator is V or numerator is None:
        return numerator
    if replicated(numerator) and torch._C._current_graph_task_id() >= 0:  # in backward
        return R
    raise Violation("mean over shard" if numerator is PAVG else "division by partial", a)


def _axis_layout(tensors: list[_Operand], a: int, out_ndim: int) -> Placement:
    """The layout of an elementwise result. A rank chunk is a guess (this rank's piece of an R
    tensor, e.g. one output of a split), and the shard of a constant is arbitrary (its pieces
    are all equal); where they do not line up with the other operands, the program uses them
    as the plain values they are on every rank, R."""
    try:
        return _shard_layout(tensors, a, out_ndim)
    except Violation:
        if not any(_loose_shard(o, a) for o in tensors):
            raise
    return _shard_layout([_as_piece(o, a) for o in tensors], a, out_ndim)


def _loose_shard(o: _Operand, a: int) -> bool:
    return type(o.pl[a]) is RankChunk or (o.const and isinstance(o.pl[a], Shard))


def _as_piece(o: _Operand, a: int) -> _Operand:
    if not _loose_shard(o, a):
        return o
    return _Operand(o.pl[:a] + (R,) + o.pl[a + 1:], o.role, o.zero, o.shape, o.scalar, o.const)


def _shard_layout(tensors: list[_Operand], a: int, out_ndim: int) -> Placement:
    shard_dims = set()
    varying, invariant_only, guessed = False, True, True
    for o in tensors:
        p = o.pl[a]
        if isinstance(p, Shard):
            shard_dims.add((norm_dim(p.dim, len(o.shape)) + out_ndim - len(o.shape), outer_of(p),
                            nested_outside(o.pl, a, len(o.shape))))
            guessed = guessed and type(p) is RankChunk
        if p is V:
            varying = True
        if p is not I:
            invariant_only = False
    if len(shard_dims) > 1:
        raise Violation("mixed shards", a)
    if shard_dims:
        ((d, outer, outside),) = shard_dims
        for o in tensors:
            if (replicated(o.pl[a]) or is_partial(o.pl[a])) and not o.const:
                local = d - (out_ndim - len(o.shape))
                if local >= 0 and not o.broadcast_on(local, outer):
                    raise Violation("global shape mismatch", a)
        if varying:
            return V
        if outer > 1:
            return BlockShard(d, outer, outside)
        return RankChunk(d) if guessed else _common_sections(tensors, a, d, outside)
    if varying:
        return V
    return I if invariant_only and tensors else R


def _common_sections(tensors: list[_Operand], a: int, d: int, outside: bool) -> Shard:
    """S(d), keeping the sections of its sharded operands. Operands cut into different sections
    (a plain shard is one section) hold their global values in different orders, so their
    local elements do not line up: a fused weight's output plus a bias cut as one slice."""
    routed = [o.pl[a] for o in tensors if type(o.pl[a]) is Routed]
    if routed:
        return _common_route(tensors, a, d, routed)
    layouts = {_sections_of(o, a) for o in tensors if isinstance(o.pl[a], Shard)}
    sectioned = any(type(o.pl[a]) is SectionShard for o in tensors)
    if sectioned and len(layouts) > 1:
        shown = " vs ".join(str(list(s)) for s in sorted(layouts))
        raise Violation("mixed shards", a, f"local sections {shown} along the sharded dim")
    return SectionShard(d, next(iter(layouts)), outside) if sectioned else S(d, outside)


def _common_route(tensors: list[_Operand], a: int, d: int, routed: list[Routed]) -> Shard:
    """Routed rows meet the same rows routed alike (their source V unless they agree), else
    rows that do not line up with theirs. Their padding rows stay zeros only in a product
    with zeros (an operand the op is linear in, none it divides by or adds)."""
    if len(routed) != sum(isinstance(o.pl[a], Shard) for o in tensors) or any(
            not routed[0].lines_up(p) for p in routed):
        raise Violation("mixed shards", a, "rows routed between the ranks meet other rows")
    sources = {p.source for p in routed}
    zeros = all(o.role in (MUL, NL) for o in tensors) and any(
        o.role == MUL and type(o.pl[a]) is Routed and o.pl[a].zero_pad for o in tensors)
    return routed[0].at(d, sources.pop() if len(sources) == 1 else V, zeros)


def _sections_of(o: _Operand, a: int) -> tuple[int, ...]:
    """The local section lengths of a sharded operand (one section for a plain shard)."""
    p = o.pl[a]
    return p.sections if type(p) is SectionShard else (o.shape[norm_dim(p.dim, len(o.shape))],)


class Linearity(enum.Enum):
    """How a pointwise op's result follows from its operands' partial sums (spmd_types'
    ``OpLinearity``)."""

    LINEAR = "linear"  # one operand, f(a + b) = f(a) + f(b): the result keeps its layout
    NONLINEAR = "nonlinear"  # no operand may be a partial sum
    MULTILINEAR = "multilinear"  # linear in each operand as its role says (ADD, MUL, DIV, NL)


_LINEAR = Linearity.LINEAR  # read at every detach, clone, ... (an enum member costs 0.1 µs)


@dataclass(frozen=True)
class OpSpec:
    """A pointwise op whose rule is its linearity alone; ``roles``: those of its leading
    positional args (an arg not given is no operand)."""

    linearity: Linearity
    roles: tuple[str, ...] = ()


def pointwise(spec: OpSpec, ctx: RuleContext, args, kwargs, out) -> Pl | None:
    """The one rule of every op in :data:`POINTWISE`: a linear op keeps its operand's layout
    (gathered blocks become unknown), any other is :func:`elementwise` over its roles."""
    if spec.linearity is _LINEAR:
        pl = ctx.types(args[0])
        if pl is None:
            return None
        for p in pl:
            if isinstance(p, Gathered):
                return tuple(None if isinstance(q, Gathered) else q for q in pl)
        return pl  # the common case (detach, clone, ...): no new tuple
    return elementwise(ctx, list(zip(args, spec.roles, strict=False)))


def _homogeneous_rule(ctx: RuleContext, args, kwargs, out):
    """clamp, relu, abs: f(c*x; c*bounds) = c*f(x; bounds) for c > 0. On an even partial
    every rank holds x = X/n, so the result is again an even share: of f of the total with
    its bounds scaled by n. On any other partial they are non-linear."""
    items = [(x, NL) for x in args[:3]]
    pl = ctx.types(args[0])
    if pl is None or PEVEN not in pl:
        return elementwise(ctx, items)
    share = Typed(tuple(R if p is PEVEN else p for p in pl), tuple(args[0].shape))
    result = elementwise(ctx, [(share, NL), *items[1:]])
    if result is None:
        return None
    return tuple(PEVEN if p is PEVEN and r is R else r for p, r in zip(pl, result, strict=True))


def _add_rule(ctx: RuleContext, args, kwargs, out):
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    other = args[1]
    if not is_tensor(other):
        other = other * alpha
    return elementwise(ctx, [(args[0], ADD), (other, ADD)])


def _where_rule(ctx: RuleContext, args, kwargs, out):
    return elementwise(ctx, [(args[0], NL), (args[1], ADD), (args[2], ADD)])


def _masked_fill_rule(ctx: RuleContext, args, kwargs, out):
    return elementwise(ctx, [(args[0], ADD), (args[1], NL), (args[2], ADD)])


def without_partial(pl: Pl | None) -> Pl | None:
    return None if pl is None else tuple(R if is_partial(p) else p for p in pl)


def _keep_layout(ctx: RuleContext, args, kwargs, out):
    """Random fills keep their template's layout (the RNG is assumed in sync); else V."""
    pl = ctx.types(args[0]) if args and is_tensor(args[0]) else None
    return (V,) * ctx.n if pl is None else without_partial(pl)


def _like_rule(ctx: RuleContext, args, kwargs, out):
    """zeros_like & co: a tensor shaped like one rank's template, so laid out like it
    (a partial template gives R: the new values are the same on every rank)."""
    pl = ctx.types(args[0])
    return (R,) * ctx.n if pl is None else without_partial(pl)


def _new_factory_rule(ctx: RuleContext, args, kwargs, out):
    """x.new_empty(size) & co: shaped like ``x`` (``x.new_empty(x.shape)``), laid out like it
    as ``empty_like(x)`` is; any other size is a fresh tensor, the same on every rank (R)."""
    if isinstance(args[0], torch.Tensor) and tuple(out.shape) == tuple(args[0].shape):
        return _like_rule(ctx, args, kwargs, out)
    return (R,) * ctx.n


def _dropout_rule(ctx: RuleContext, args, kwargs, out):
    pl = ctx.types(args[0])
    return None if pl is None else [pl, without_partial(pl)]


# --- reductions ----------------------------------------------------------------------------

def reduced_dims(dim: Any, ndim: int) -> set[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    return {norm_dim(d, max(ndim, 1)) for d in dim}


def reduction(kind: str, dim_pos: int = 1, keep_pos: int = 2) -> Callable:
    """sum-like (kind 'sum'), mean ('mean'), max-like ('max') or non-linear ('norm') reductions."""
    @on_typed_operand
    def rule(ctx: RuleContext, x, pl, args, kwargs, out):
        ndim = x.dim()
        dims = reduced_dims(arg(args, kwargs, dim_pos, "dim"), ndim)
        keep = bool(arg(args, kwargs, keep_pos, "keepdim", False))
        pl = tuple(moved(p, norm_dim(p.dim, max(ndim, 1))) if isinstance(p, Shard) and p.dim < 0
                   else p for p in pl)  # S(-1) and S(ndim-1) are the same shard
        even = ctx.const(x)  # equal shards of a constant sum to equal shares
        reduce_kind = "sum" if kind == "max" and _over_single_elements(x, pl, dims) else kind
        return tuple(_reduce_axis(reduce_kind, p, a, dims, keep, even) for a, p in enumerate(pl))
    return rule


def _over_single_elements(x: torch.Tensor, pl: Pl, dims: set[int]) -> bool:
    """A reduction over dims of one element that no axis shards (so one globally too): a max
    there is each element itself, linear as a sum."""
    return x.dim() > 0 and all(x.shape[d] == 1 for d in dims) and not any(
        isinstance(p, Shard) and p.dim in dims for p in pl)


def _reduce_axis(kind: str, p: Placement | None, a: int, dims: set[int], keep: bool,
                 even: bool = False):
    if p is None or isinstance(p, Gathered):
        return None
    if is_partial(p):
        if kind in ("sum", "mean"):
            return p
        raise Violation("mean over shard" if p is PAVG else "non-linear on partial", a)
    if not isinstance(p, Shard):
        return p
    if p.dim in dims:
        if type(p) is Routed and p.pad and (kind == "mean" or kind == "sum" and not p.zero_pad):
            return V  # padding rows summed in, or counted in a mean
        if kind == "sum":
            return PEVEN if even else P
        if kind == "mean":
            return PAVG
        if kind == "max":
            return V
        raise Violation("normalization over shard", a)
    return p if keep else moved(p, p.dim - sum(1 for d in dims if d < p.dim))


def _count_nonzero_rule(ctx: RuleContext, args, kwargs, out):
    """``count_nonzero``: a sum of a non-linear indicator. Counts of shards add up to the
    whole count (P); the count of a partial value is no part of the count of the sum."""
    pl = ctx.types(args[0])
    if pl is None:
        return None
    for a, p in enumerate(pl):
        if is_partial(p):
            raise Violation("non-linear on partial", a)
    return _count_reduction(ctx, args, kwargs, out)


_count_reduction = reduction("sum")


@on_typed_operand
def _normalize_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    """softmax / log_softmax over ``dim``."""
    dim = norm_dim(args[1], x.dim())
    for a, p in enumerate(pl):
        if is_partial(p):
            raise Violation("mean over shard" if p is PAVG else "non-linear on partial", a)
        if isinstance(p, Shard) and norm_dim(p.dim, x.dim()) == dim:
            raise Violation("normalization over shard", a)
    return _no_gathered(pl)


def _no_gathered(pl: Pl) -> Pl:
    """A normalisation of gathered blocks (stacked on dim 0, not joined) mixes the blocks."""
    return tuple(None if isinstance(p, Gathered) else p for p in pl)


def _normalize_backward_rule(ctx: RuleContext, args, kwargs, out):
    """_softmax_backward_data / _log_softmax_backward_data(grad, output, dim, dtype)."""
    _normalize_rule(ctx, (args[1], args[2]), {}, out)
    return elementwise(ctx, [(args[0], MUL), (args[1], NL)])


@on_typed_operand
def _layer_norm_rule(ctx: RuleContext, x, pl, args, kwargs, out):
    """native_layer_norm(input, normalized_shape, weight, bias, eps) -> (out, mean, rstd)."""
    first = x.dim() - len(args[1])
    for a, p in enumerate(pl):
        if is_partial(p):
            raise Violation("mean over shard" if p is PAVG else "non-linear on partial", a)
        if isinstance(p, Shard) and norm_dim(p.dim, x.dim()) >= first:
            raise Violation("normalization over shard", a)
    weight, bias = arg(args, kwargs, 2, "weight"), arg(args, kwargs, 3, "bias")
    y = elementwise(ctx, [(x, NL), (weight, NL), (bias, NL)])
    return [None if y is None else _no_gathered(y), _no_gathered(pl), _no_gathered(pl)]


def join(a: Pl | None, b: Pl | None) -> Pl | None:
    if a is None or b is None:
        return None
    return tuple(x if x == y else None for x, y in zip(a, b, strict=True))


def _layer_norm_backward_rule(ctx: RuleContext, args, kwargs, out):
    """native_layer_norm_backward(grad, input, shape, mean, rstd, weight, bias, mask)."""
    grad, x = args[0], args[1]
    g = elementwise(ctx, [(grad, MUL), (x, NL)])
    if g is None:
        return None
    lead = set(range(x.dim() - len(args[2])))
    param = tuple(_reduce_axis("sum", p, a, lead, False) for a, p in enumerate(g))
    return [g, param, param]


def _activation_backward(ctx: RuleContext, args, kwargs, out):
    """gelu_backward(grad, self), silu_backward, threshold_backward, ...: linear in grad."""
    return elementwise(ctx, [(args[0], MUL), (args[1], NL)])


def _dropout_backward(ctx: RuleContext, args, kwargs, out):
    return elementwise(ctx, [(args[0], MUL), (args[1], MUL)])


# --- factories and scalar reads (contractions: see contraction.py) -------------------------

def _replicated_rule(ctx: RuleContext, args, kwargs, out):
    return (R,) * ctx.n


def _varying_rule(ctx: RuleContext, args, kwargs, out):
    return (V,) * ctx.n


def _scalar_rule(ctx: RuleContext, args, kwargs, out):
    """``.item()``: a Python number read from a tensor. Read from a value that is not the same
    on every rank of some axis, it differs per rank there: remembered (by value) so that the
    ops it later enters are V on those axes (see ``Checker.rank_scalars``)."""
    pl = ctx.types(args[0]) if is_tensor(args[0]) else None
    if pl is not None and isinstance(out, int | float) and not isinstance(out, bool):
        axes = tuple(a for a, p in enumerate(pl) if p is not None and not replicated(p))
        if axes:
            ctx.remember_rank_scalar(out, axes)
    return NO_TENSOR


# --- the table -----------------------------------------------------------------------------

NONLINEAR_UNARY = [
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "gelu", "silu", "sigmoid",
    "tanh", "sqrt", "rsqrt", "erf", "erfinv", "sin", "cos", "reciprocal", "sign", "sgn",
    "floor", "ceil", "round", "trunc", "frac", "isnan", "isinf", "isfinite", "logical_not",
    "hardtanh", "leaky_relu", "elu", "softplus", "mish", "hardswish", "hardsigmoid",
    "nan_to_num", "bitwise_not", "logit", "relu6", "square", "threshold", "pow", "tril", "triu",
    "any", "all", "sort", "topk", "cumsum", "cumprod",
]
POSITIVELY_HOMOGENEOUS = ["clamp", "clamp_min", "clamp_max", "relu", "abs"]
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
_NONLINEAR = OpSpec(Linearity.NONLINEAR, (NL, NL))
POINTWISE: dict[str, OpSpec] = {
    **dict.fromkeys(NONLINEAR_UNARY, _NONLINEAR),
    **dict.fromkeys(NONLINEAR_BINARY, _NONLINEAR),
    **dict.fromkeys(LINEAR_UNARY, OpSpec(Linearity.LINEAR)),
    "mul": OpSpec(Linearity.MULTILINEAR, (MUL, MUL)),
    "div": OpSpec(Linearity.MULTILINEAR, (MUL, DIV)),
    "true_divide": OpSpec(Linearity.MULTILINEAR, (MUL, DIV)),
    "lerp": OpSpec(Linearity.NONLINEAR, (NL, NL, NL)),
    "addcmul": OpSpec(Linearity.MULTILINEAR, (ADD, MUL, MUL)),
    "addcdiv": OpSpec(Linearity.MULTILINEAR, (ADD, MUL, DIV)),
}
ACTIVATION_BACKWARD = [
    "gelu_backward", "silu_backward", "threshold_backward", "sigmoid_backward", "tanh_backward",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
    "mish_backward", "hardswish_backward",
]
FACTORIES = [
    "zeros", "ones", "full", "empty", "empty_strided", "arange", "eye", "scalar_tensor",
    "linspace", "logspace", "lift_fresh", "tensor",
]
NEW_FACTORIES = ["new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided"]
LIKE_FACTORIES = ["zeros_like", "ones_like", "full_like", "empty_like"]
RANDOM_FACTORIES = ["rand", "randn", "randint", "randperm"]
RANDOM_FROM_TEMPLATE = [
    "rand_like", "randn_like", "randint_like", "bernoulli", "uniform", "normal", "random",
    "exponential", "cauchy", "log_normal", "geometric",
]
ZERO_MAKERS = {"zeros", "zeros_like", "new_zeros", "zero"}
FILL_OPS = {  # constant; zero when the value is 0
    "full", "full_like", "new_full", "fill", "scalar_tensor", "ones", "ones_like", "new_ones",
}
CONST_PRESERVING = {  # elementwise: constant when every tensor operand is
    "add", "sub", "rsub", "mul", "div", "true_divide", "neg", "exp", "log", "sqrt", "rsqrt",
    "pow", "reciprocal", "sigmoid", "tanh", "relu", "gelu", "silu", "abs", "where",
}

_reduce = {
    "sum": reduction("sum"), "nansum": reduction("sum"), "mean": reduction("mean"),
    "nanmean": reduction("mean"), "amax": reduction("max"), "amin": reduction("max"),
    "max": reduction("max"), "min": reduction("max"), "argmax": reduction("max"),
    "argmin": reduction("max"), "prod": reduction("norm"), "logsumexp": reduction("norm"),
    "linalg_vector_norm": reduction("norm", 2, 3), "norm": reduction("norm"),
    "var": reduction("norm"), "std": reduction("norm"), "var_mean": reduction("norm"),
    "std_mean": reduction("norm"), "count_nonzero": _count_nonzero_rule,
}


def _base_table() -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    table.update({name: functools.partial(pointwise, spec) for name, spec in POINTWISE.items()})
    table.update(dict.fromkeys(POSITIVELY_HOMOGENEOUS, _homogeneous_rule))
    table.update(dict.fromkeys(ACTIVATION_BACKWARD, _activation_backward))
    table.update(dict.fromkeys(FACTORIES, _replicated_rule))
    table.update(dict.fromkeys(RANDOM_FACTORIES, _varying_rule))
    table.update(dict.fromkeys(RANDOM_FROM_TEMPLATE, _keep_layout))
    table.update(dict.fromkeys(LIKE_FACTORIES, _like_rule))
    table.update(dict.fromkeys(NEW_FACTORIES, _new_factory_rule))
    table.update(_reduce)
    table.update({
        "add": _add_rule, "sub": _add_rule, "rsub": _add_rule,
        "where": _where_rule, "masked_fill": _masked_fill_rule,
        "zero": _replicated_rule,
        "native_dropout": _dropout_rule, "native_dropout_backward": _dropout_backward,
        "_softmax": _normalize_rule, "_log_softmax": _normalize_rule,
        "softmax": _normalize_rule, "log_softmax": _normalize_rule,
        # scaled_dot_product_attention's CPU math path normalises with _safe_softmax(x, dim)
        "_safe_softmax": _normalize_rule,
        "_softmax_backward_data": _normalize_backward_rule,
        "_log_softmax_backward_data": _normalize_backward_rule,
        "native_layer_norm": _layer_norm_rule,
        "native_layer_norm_backward": _layer_norm_backward_rule,
        "_local_scalar_dense": _scalar_rule, "sym_size": _scalar_rule,
        "sym_numel": _scalar_rule, "equal": _scalar_rule, "is_nonzero": _scalar_rule,
    })
    return table


RULES: dict[str, Callable] = _base_table()
"""Arithmetic, reduction, contraction and factory rules per op base name ("add" covers
add.Tensor, add_.Scalar, add.out, ...); shape ops are in shardcheck.typecheck.rules.shape."""
