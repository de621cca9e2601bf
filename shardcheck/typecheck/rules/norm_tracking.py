"""Follow squared gradients into a global-norm all-reduce and check their accounting there.

A square, ``pow(2)`` or vector norm of a named parameter's gradient starts a *norm term*:
the tensor is tagged with the parameter and its gradient's type. So does a count of its
entries (``count_nonzero``, and the gradient's ``numel()`` minus that: Megatron's num-zeros),
which adds over elements as a square does. Sums, stacks, concatenations and additions of
terms merge the tags. Their own type is R on an axis where every counted
gradient is R, else P: a replicated gradient counted on one rank only is a partial sum there.
At a SUM all-reduce of a one-element tensor, the ranks of the group exchange what they counted
(so that every rank takes part in the exchange, whether or not its tensor is tagged) and
:mod:`shardcheck.typecheck.norm_accounting` checks the counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.norm_accounting import AccountingError, Counted, accounting_errors
from shardcheck.typecheck.rules import collectives
from shardcheck.typecheck.rules.common import NO_TENSOR, Refinement, RuleContext, gathered_objects
from shardcheck.typecheck.rules.gradient import (
    gradient_of,
    has_named_parameters,
    named_parameters,
    report,
)
from shardcheck.typecheck.types import P, R

aten = torch.ops.aten


@dataclass(frozen=True)
class NormTerm:
    """The parameters a tensor counts (name -> gradient placement per axis) and its power:
    1 for a norm, 2 for what adds over elements (a squared norm, or with ``count`` a count
    of entries)."""

    params: dict
    power: int
    count: bool = False

    def placements(self, n: int) -> tuple:
        return tuple(R if all(pl[a] is R for pl in self.params.values()) else P for a in range(n))


def _term(t) -> NormTerm | None:
    return tensor_state.read(t, "norm")


def _tag(ctx: RuleContext, t: torch.Tensor, term: NormTerm) -> tuple:
    tensor_state.write(t, "norm", term)
    return term.placements(ctx.n)


# --- which tensors are gradients --------------------------------------------------------------

def _gradient_param(ctx: RuleContext, t) -> tuple[str, tuple] | None:
    """(name, gradient placements) when ``t`` is a named parameter's gradient."""
    if (not isinstance(t, torch.Tensor) or t.requires_grad
            or torch._C._current_autograd_node() is not None):
        return None
    address, shape = t.data_ptr(), t.shape
    for name, param in named_parameters(ctx):
        grad = gradient_of(param)
        if grad is t or (grad is not None and grad.data_ptr() == address and grad.shape == shape):
            pl = ctx.types(t)
            return None if pl is None or None in pl else (name, pl)
    return None


def _start(ctx: RuleContext, out, t, power: int, count: bool = False) -> tuple | None:
    """Tag ``out`` as a term of ``t`` when ``t`` is a gradient; its placements as a reduced term."""
    found = _gradient_param(ctx, t)
    if found is None:
        return None
    return _tag(ctx, out, NormTerm({found[0]: found[1]}, power, count))


def _start_elementwise(base, ctx: RuleContext, args, kwargs, out) -> tuple | None:
    """Tag an elementwise square of a gradient; its type is the ordinary one (S stays S)."""
    if _start(ctx, out, args[0], 2) is None:
        return None
    return base(ctx, args, kwargs, out)


# --- rules for the ops a norm is made of ----------------------------------------------------

def _or_base(tagged_rule):
    """A refinement: ``tagged_rule`` (given the base rule), where it returns None the base
    rule. A tagged rule tests its cheapest premise first: it runs at every mul and add."""
    def rule(base, ctx: RuleContext, args, kwargs, out):
        pl = tagged_rule(base, ctx, args, kwargs, out)
        return base(ctx, args, kwargs, out) if pl is None else pl
    return rule


def _pow(base, ctx: RuleContext, args, kwargs, out):
    x, exponent = args[0], args[1]
    if not isinstance(x, torch.Tensor) or not isinstance(exponent, (int, float)) or exponent != 2:
        return None
    term = _term(x)
    if term is not None:
        return _tag(ctx, out, NormTerm(term.params, term.power * 2)) if term.power == 1 else None
    return _start_elementwise(base, ctx, args, kwargs, out)


def _mul(base, ctx: RuleContext, args, kwargs, out):
    if args[0] is args[1] and _term(args[0]) is None:
        return _start_elementwise(base, ctx, args, kwargs, out)
    return None


def _vector_norm(base, ctx: RuleContext, args, kwargs, out):
    order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dims = args[2] if len(args) > 2 else kwargs.get("dim")
    if order != 2 or dims:
        return None
    return _start(ctx, out, args[0], 1)


def _count_nonzero(base, ctx: RuleContext, args, kwargs, out):
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims not in (None, [], ()):
        return None
    return _start(ctx, out, args[0], 2, count=True)


def _rsub(base, ctx: RuleContext, args, kwargs, out):
    """``grad.numel() - count_nonzero(grad)``: the gradient's zeros, a count of its entries too."""
    term = _term(args[0])
    if term is None or not term.count or len(term.params) != 1 or not isinstance(args[1], int):
        return None
    grad = gradient_of(dict(named_parameters(ctx))[next(iter(term.params))])
    if grad is None or args[1] != grad.numel():
        return None
    return _tag(ctx, out, term)


def _merge(ctx: RuleContext, out, operands) -> tuple | None:
    """Union of the operands' terms; untagged operands must be known zeros."""
    terms = [_term(t) for t in operands]
    if not any(terms):
        return None
    if any(term is None and not ctx.zero(t) for term, t in zip(terms, operands, strict=True)):
        return None
    kinds = {(term.power, term.count) for term in terms if term}
    if len(kinds) != 1:
        return None
    params = {}
    for term in terms:
        params.update(term.params if term else {})
    power, count = kinds.pop()
    return _tag(ctx, out, NormTerm(params, power, count))


def _sum(base, ctx: RuleContext, args, kwargs, out):
    return _merge(ctx, out, [args[0]])


def _stack(base, ctx: RuleContext, args, kwargs, out):
    return _merge(ctx, out, list(args[0]))


def _add(base, ctx: RuleContext, args, kwargs, out):
    a, b = args[0], args[1]
    if _term(a) is None and _term(b) is None:
        return None
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    return _merge(ctx, out, [a, b])


def _foreach_norm(ctx: RuleContext, args, kwargs, out):
    order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if order != 2 or not has_named_parameters(ctx):
        return None
    return [_start(ctx, o, g, 1) for g, o in zip(args[0], out, strict=True)]



# --- the all-reduce of a norm ---------------------------------------------------------------

def _allreduce(base, ctx: RuleContext, args, kwargs, out):
    tensors, group = args[0], args[1]
    if (len(tensors) != 1 or tensors[0].numel() != 1 or not has_named_parameters(ctx)
            or collectives._reduce_op(args[2]) != collectives.SUM):  # a call into TorchScript: last
        return base(ctx, args, kwargs, out)
    t = tensors[0]
    term = _term(t)
    axes = collectives._axes(ctx, group)
    if not ctx.rerun:  # a re-run after a violation exchanged and reported already
        _check_accounting(ctx, group, axes, term)
    if term is None:
        return base(ctx, args, kwargs, out)
    tensor_state.write(t, "norm", None)
    pl = list(term.placements(ctx.n))
    for a in axes:
        pl[a] = R
    ctx.update_inplace(t, tuple(pl))
    return NO_TENSOR


def _check_accounting(ctx: RuleContext, group, axes: list[int], term: NormTerm | None) -> None:
    """Exchange what the ranks counted and report what they counted wrong."""
    everyone = _exchange(ctx, group, axes, term)
    errors = [] if everyone is None else accounting_errors(
        everyone, [ctx.names[a] for a in axes], [ctx.sizes[a] for a in axes])
    if term is not None and term.power != 2 and axes:
        errors.append(_summed_norms(term, ctx.names[axes[0]]))
    report(ctx, errors, "all_reduce of a gradient norm")


def _exchange(ctx: RuleContext, group, axes, term: NormTerm | None) -> list[Counted] | None:
    """What every rank of ``group`` counted; None where ranks cannot talk (fake groups)."""
    params = {} if term is None else {
        name: tuple("R" if pl[a] is R else repr(pl[a]) for a in axes)
        for name, pl in term.params.items()}
    everyone = gathered_objects(collectives.process_group(group), Counted(tuple(ctx.index[a] for a in axes), params))
    if everyone is None or not any(c.params for c in everyone):
        return None
    return everyone


def _summed_norms(term: NormTerm, axis: str) -> AccountingError:
    names = sorted(term.params)
    return AccountingError(names[0], axis, f"norms (not squared norms) of {', '.join(names)} "
                           f"are summed over {axis}: square them before the all-reduce")


def _on_packets(name: str) -> tuple:
    """aten ``name`` and, where there is one, its in-place ``name_``."""
    return tuple(getattr(aten, packet) for packet in (name, name + "_") if hasattr(aten, packet))


RULES_BY_OP = {aten._foreach_norm: _foreach_norm}
REFINEMENTS = (
    *(Refinement(_on_packets(name), _or_base(rule), name)
      for name, rule in (("pow", _pow), ("mul", _mul), ("linalg_vector_norm", _vector_norm),
                         ("count_nonzero", _count_nonzero), ("rsub", _rsub), ("sum", _sum),
                         ("stack", _stack), ("cat", _stack), ("add", _add))),
    Refinement((torch.ops.c10d.allreduce_,), _allreduce, ("c10d", "allreduce_")),
)
