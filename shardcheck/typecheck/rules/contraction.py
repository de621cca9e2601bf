"""Typing rules for contractions (matmuls, einsum), embedding lookups and the NLL loss: ops
that sum over a dim or pick rows of a table. Part of the rule table (see :mod:`registry`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardcheck.typecheck.broadcast import fits_shard
from shardcheck.typecheck.rules.arithmetic import ADD, Typed, _reduce_axis, elementwise
from shardcheck.typecheck.rules.common import (
    RuleContext,
    arg,
    is_partial,
    is_sum,
    moved,
    nested_outside,
    norm_dim,
    outer_of,
    replicated,
)
from shardcheck.typecheck.types import (
    PAVG,
    Gathered,
    I,
    P,
    Pl,
    Placement,
    R,
    RankChunk,
    Routed,
    S,
    Shard,
    V,
)
from shardcheck.typecheck.violations import Violation


def einsum_rule(ctx: RuleContext, specs: list[tuple[Any, str]], out_spec: str) -> Pl | None:
    """Type a contraction given each operand's dim letters and the output's letters.

    A constant operand (every element equal) is a slice of a constant global tensor, so it
    fits any layout: it is left out of the layout decision. So does, along a sharded letter,
    an operand that holds one value along it (a broadcast; see shardcheck.typecheck.broadcast).
    """
    pls = []
    for t, letters in specs:
        pl = ctx.types(t)
        if pl is None:
            return None
        if not (ctx.const(t) and all(p is None or replicated(p) for p in pl)):
            pls.append((pl, letters, t))
    if not pls:
        return ctx.types(specs[0][0])
    first = pls[0][0]
    if all(pl == first for pl, _, _ in pls) and all(p is R or p is V or p is I for p in first):
        return first  # R@R, V@V: the common case, fast
    return tuple(_guessed_contract(pls, a, out_spec) for a in range(ctx.n))


def _guessed_contract(pls, a: int, out_spec: str) -> Placement | None:
    """A contraction on axis ``a``. A rank chunk is a guess (see :func:`_axis_layout`): where
    it does not line up with the other operands, it is the plain value every rank holds, R."""
    try:
        return _axis_contract(pls, a, out_spec)
    except Violation:
        if not any(type(pl[a]) is RankChunk for pl, _, _ in pls):
            raise
    plain = [(pl[:a] + (R,) + pl[a + 1:] if type(pl[a]) is RankChunk else pl, spec, t)
             for pl, spec, t in pls]
    return _axis_contract(plain, a, out_spec)


def _axis_contract(pls, a: int, out_spec: str) -> Placement | None:
    ps = [pl[a] for pl, _, _ in pls]
    if any(type(p) is Routed for p in ps):
        return _routed_contract(ps, [spec for _, spec, _ in pls], out_spec)
    partial = False
    for p in ps:
        if p is None or type(p) is Gathered:
            return None
        if is_partial(p):
            partial = True
    if partial:
        if PAVG in ps:
            raise Violation("mean over shard", a)
        if sum(1 for p in ps if is_sum(p)) > 1 or any(isinstance(p, Shard) for p in ps):
            raise Violation("partial product", a)
        return V if V in ps else P
    letters, shard = set(), None
    for p, (pl, spec, _) in zip(ps, pls, strict=True):
        if isinstance(p, Shard):
            letters.add((spec[norm_dim(p.dim, len(spec))], outer_of(p), nested_outside(pl, a, len(spec))))
            shard = p
    if len(letters) > 1:
        raise Violation("mixed shards", a)
    if V in ps:
        return V
    if not letters:
        return I if all(p is I for p in ps) else R
    ((letter, outer, outside),) = letters
    for p, (_, spec, t) in zip(ps, pls, strict=True):
        if replicated(p) and letter in spec and not fits_shard(t, spec.index(letter), outer):
            raise Violation("global shape mismatch", a)
    return moved(shard, out_spec.index(letter), outside) if letter in out_spec else P


def _routed_contract(ps: list, specs: list[str], out_spec: str) -> Placement:
    """A contraction of routed rows (see :mod:`routed`) with rows routed alike and with
    replicated operands or the rank's own group's (a shard of another dim): row-wise, the
    routed rows (padding rows of zeros in any factor give zeros); over the rows, one local
    group's complete value (S(0)) or a share of a sum over all rows (P), where padding rows
    add nothing: zeros in some factor. Anything else: V."""
    routed = [(p, spec[norm_dim(p.dim, len(spec))]) for p, spec in zip(ps, specs, strict=True) if type(p) is Routed]
    first, letter = routed[0]
    if any(not first.lines_up(p) or row != letter for p, row in routed):
        return V
    others = [(p, spec) for p, spec in zip(ps, specs, strict=True) if type(p) is not Routed]
    if not all(replicated(p) or (type(p) is Shard and spec[norm_dim(p.dim, len(spec))] != letter)
               for p, spec in others):
        return V
    zeros = any(p.zero_pad for p, _ in routed)
    if letter in out_spec:
        sources = {p.source for p, _ in routed}
        return first.at(out_spec.index(letter), sources.pop() if len(sources) == 1 else V, zeros)
    if any(isinstance(p, Shard) for p, _ in others) or not zeros:
        return V
    return S(0) if first.complete() else P


def _mm(ctx: RuleContext, args, kwargs, out):
    return einsum_rule(ctx, [(args[0], "nk"), (args[1], "km")], "nm")


def _bmm(ctx: RuleContext, args, kwargs, out):
    return einsum_rule(ctx, [(args[0], "bnk"), (args[1], "bkm")], "bnm")


def _mv(ctx: RuleContext, args, kwargs, out):
    return einsum_rule(ctx, [(args[0], "nk"), (args[1], "k")], "n")


def _dot(ctx: RuleContext, args, kwargs, out):
    return einsum_rule(ctx, [(args[0], "k"), (args[1], "k")], "")


def _with_bias(contract: Callable) -> Callable:
    """addmm/baddbmm(bias, a, b, beta, alpha): the product plus a broadcast bias (ignored
    with beta=0, as Megatron's attention does with an uninitialised buffer)."""
    def rule(ctx: RuleContext, args, kwargs, out):
        product = contract(ctx, args[1:], kwargs, out)
        if product is None or arg(args, kwargs, 3, "beta", 1) == 0:
            return product
        return elementwise(ctx, [(args[0], ADD), (Typed(product, tuple(out.shape)), ADD)])
    return rule


_SPATIAL, _KERNEL = "lmn", "pqr"  # the letters of a convolution's spatial and kernel dims


def _conv_letters(ctx: RuleContext, x: torch.Tensor, weight: torch.Tensor, groups: int,
                  *spatial: torch.Tensor) -> tuple[str, str, str] | None:
    """The dim letters of a convolution's input, weight and output, as a contraction over
    input channels and kernel positions: plain (``groups=1``) or depthwise (one input channel
    per group: the channel dim is the group's, shared by all three). None, left untyped, for
    other groupings and for a tensor cut along a spatial dim (each output position reads its
    neighbours' inputs across the cut)."""
    dims = x.dim() - 2
    if groups != 1 and weight.shape[1] != 1:
        return None
    for t in (x, *spatial):
        pl = ctx.types(t)
        if pl is not None and any(isinstance(p, Shard) and norm_dim(p.dim, t.dim()) >= 2 for p in pl):
            return None
    channel, contracted = ("g", "x") if groups != 1 else ("o", "c")
    source = "g" if groups != 1 else "c"
    return (f"b{source}{_SPATIAL[:dims]}", f"{channel}{contracted}{_KERNEL[:dims]}",
            f"b{channel}{_SPATIAL[:dims]}")


def _convolution_rule(ctx: RuleContext, args, kwargs, out):
    """convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
    groups): a contraction of the input's channels with the weight, plus a bias per output
    channel (see :func:`_conv_letters`)."""
    x, weight, bias = args[0], args[1], arg(args, kwargs, 2, "bias", None)
    letters = None if arg(args, kwargs, 6, "transposed", False) else _conv_letters(
        ctx, x, weight, arg(args, kwargs, 8, "groups", 1))
    if letters is None:
        return None
    product = einsum_rule(ctx, [(x, letters[0]), (weight, letters[1])], letters[2])
    if product is None or bias is None:
        return product
    per_channel = ctx.types(bias)  # [C_out], added along the output's dim 1
    if per_channel is None:
        return None
    lifted = tuple(moved(p, 1) if isinstance(p, Shard) else p for p in per_channel)
    return elementwise(ctx, [(Typed(product, tuple(out.shape)), ADD),
                             (Typed(lifted, (1, bias.shape[0], *[1] * (out.dim() - 2))), ADD)])


def _convolution_backward_rule(ctx: RuleContext, args, kwargs, out):
    """convolution_backward(grad, input, weight, bias_sizes, stride, padding, dilation,
    transposed, output_padding, groups, output_mask): the input's gradient contracts the
    output's with the weight, the weight's the output's with the input (over the batch and
    the positions), the bias's sums the output's over both."""
    grad, x, weight = args[0], args[1], args[2]
    letters = None if args[7] else _conv_letters(ctx, x, weight, args[9], grad)
    if letters is None:
        return None
    into, kernel, out_letters = letters
    channel = out_letters[1]
    return [einsum_rule(ctx, [(grad, out_letters), (weight, kernel)], into),
            einsum_rule(ctx, [(grad, out_letters), (x, into)], kernel),
            einsum_rule(ctx, [(grad, out_letters)], channel)]


def _embedding_rule(ctx: RuleContext, args, kwargs, out):
    """embedding(weight, indices): a vocab-sharded weight yields a partial (masked) lookup."""
    weight, idx = args[0], args[1]
    wl, il = ctx.types(weight), ctx.types(idx)
    if wl is None or il is None:
        return None
    result = []
    for a, (w, i) in enumerate(zip(wl, il, strict=True)):
        if w is None or i is None:
            result.append(None)
        elif is_partial(i):
            raise Violation("non-linear on partial", a)
        elif w is V or i is V:
            result.append(V)
        elif isinstance(w, Shard) and isinstance(i, Shard):
            raise Violation("mixed shards", a)
        elif isinstance(w, Shard):
            result.append(P if norm_dim(w.dim, 2) == 0 else S(idx.dim()))
        elif isinstance(i, Shard):
            result.append(i)
        else:
            result.append(w)
    return tuple(result)


def _embedding_backward_rule(ctx: RuleContext, args, kwargs, out):
    """embedding_dense_backward(grad, indices, num_weights, padding_idx, scale).

    Where the table is cut into rows (the lookup was the masked partial one), each rank sums
    the gradient into its own rows: a replicated gradient gives the table's own row shard.
    """
    grad = args[0]
    pl = ctx.types(grad)
    if pl is None:
        return None
    last = grad.dim() - 1
    tokens = set(range(last))
    table = ctx.types(looked_up_table("EmbeddingBackward0")) or (None,) * len(pl)
    return tuple(row_gradient(t, p) if cut_into_rows(t, 2)
                 else S(1) if isinstance(p, Shard) and norm_dim(p.dim, grad.dim()) == last
                 else _reduce_axis("sum", p, a, tokens, False)
                 for a, (p, t) in enumerate(zip(pl, table, strict=True)))


def in_backward_of(node_name: str) -> bool:
    """Whether the op runs in the backward of the autograd node ``node_name``."""
    node = torch._C._current_autograd_node()
    return node is not None and node.name() == node_name


def looked_up_table(node_name: str) -> torch.Tensor | None:
    """The table a lookup's backward computes the gradient of: the leaf tensor the running
    autograd node ``node_name`` feeds. None elsewhere, or for a table made by other ops."""
    node = torch._C._current_autograd_node()
    if node is None or node.name() != node_name or not node.next_functions:
        return None
    table = getattr(node.next_functions[0][0], "variable", None)
    return table if isinstance(table, torch.Tensor) else None


def cut_into_rows(p: Placement | None, ndim: int) -> bool:
    return isinstance(p, Shard) and norm_dim(p.dim, ndim) == 0


def row_gradient(table: Shard, grad: Placement | None) -> Placement | None:
    """A row-cut table's gradient from an output gradient that every rank holds whole: the
    table's own shard. Any other output gradient gives rows with no global meaning: V."""
    if grad is None:
        return None
    return table if replicated(grad) else V


def _nll_rule(ctx: RuleContext, args, kwargs, out):
    """nll_loss_forward(self, target, weight, reduction, ignore_index) -> (loss, total_weight)."""
    x, target = args[0], args[1]
    xl, tl = ctx.types(x), ctx.types(target)
    if xl is None or tl is None:
        return None
    reduction = arg(args, kwargs, 3, "reduction", 1)
    class_dim = 1 if x.dim() > 1 else 0
    loss, weight = [], []
    for a, (p, t) in enumerate(zip(xl, tl, strict=True)):
        if p is None or t is None:
            loss.append(None)
            weight.append(None)
            continue
        if isinstance(p, Shard) and norm_dim(p.dim, x.dim()) == class_dim:
            raise Violation("normalization over shard", a)
        if p is PAVG:
            raise Violation("mean over shard", a)
        lay = p if not replicated(p) else t
        if is_partial(t):
            raise Violation("non-linear on partial", a)
        loss.append(_nll_reduce(lay, reduction))
        weight.append(_nll_reduce(t, 2) if isinstance(t, Shard) else (V if t is V else R))
    return [tuple(loss), tuple(weight)]


def _nll_reduce(p: Placement, reduction: int) -> Placement:
    if isinstance(p, Shard) and reduction != 0:
        return P if reduction == 2 else PAVG
    return p


def _nll_backward_rule(ctx: RuleContext, args, kwargs, out):
    """nll_loss_backward(grad, self, target, weight, reduction, ignore_index, total_weight)."""
    gl, xl = ctx.types(args[0]), ctx.types(args[1])
    if gl is None or xl is None:
        return None
    result = []
    for g, x in zip(gl, xl, strict=True):
        if g is None or x is None:
            result.append(None)
        else:
            result.append(g if is_sum(g) or g is V else x)
    return tuple(result)


RULES: dict[str, Callable] = {
    "mm": _mm, "bmm": _bmm, "mv": _mv, "dot": _dot,
    "addmm": _with_bias(_mm), "baddbmm": _with_bias(_bmm),
    "embedding": _embedding_rule, "embedding_dense_backward": _embedding_backward_rule,
    "nll_loss_forward": _nll_rule, "nll_loss_backward": _nll_backward_rule,
    "convolution": _convolution_rule, "convolution_backward": _convolution_backward_rule,
}
"""Contraction rules per op base name."""
