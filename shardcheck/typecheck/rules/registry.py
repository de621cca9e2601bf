"""The one rule table, and what is known of an op's result value.

Every rule module declares its rules as data (a table by aten base name or by op, and the
:class:`~shardcheck.typecheck.rules.common.Refinement` of rules it refines); this module
imports each of them and builds the table, in a fixed order, so nothing registers by side
effect. It is the only module that changes the table: :func:`register_rule` (the public
``shardcheck.register_rule``) and :func:`unregister_rule` go through it.

A rule is ``rule(ctx, args, kwargs, out)``: it returns the result's placements (see
:mod:`~shardcheck.typecheck.rules.arithmetic`) or raises a
:class:`~shardcheck.typecheck.violations.Violation`.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from shardcheck.typecheck.rules import (
    arithmetic,
    backward,
    collectives,
    contraction,
    gradient,
    indexing,
    norm_tracking,
    shape,
    sum_gradient,
    token_rows,
)
from shardcheck.typecheck.rules.common import NO_TENSOR, Refinement, Rule, RuleContext


class Known(enum.IntFlag):
    """What is known of a tensor's value, kept with its type."""

    NOTHING = 0
    # every element equal (a slice of a constant global tensor fits any layout)
    CONST = 1
    # all zero (also fits a partial sum)
    ZERO = 2
    # replicated zeros that one value was added into (``acc = zeros; if rank == 0: acc += x``):
    # a rank cannot tell whether the others added too (a sum over the axis, P) or hold zeros
    ACC = 4
    # ACC added in a branch on the rank: likely one rank's contribution alone, so an op on it
    # other than its sum is V (see ``Checker._after_accumulation``). Added by every rank (Adam's
    # zero states, a token count summed per microbatch) ACC stays the value itself.
    ONE_RANK = 8


# Known's members and bit tests for the per-op path: reading an enum member costs about 0.1 µs,
# and an IntFlag operator (``flags & Known.ACC``) about 1 µs, at every op. Flags are ints below 16.
NOTHING, CONST, ZERO, ACC = Known.NOTHING, Known.CONST, Known.ZERO, Known.ACC
CONST_OR_ZERO = frozenset({CONST, ZERO})
WITH_ACC = frozenset(flags for flags in range(16) if flags & ACC)
WITH_ONE_RANK = frozenset(flags for flags in range(16) if flags & Known.ONE_RANK)


class ValueRule(enum.Enum):
    """How an op's result's :class:`Known` follows from its inputs'."""

    ZERO = "made zero"
    FILL = "constant, zero when its value arg is 0"
    KEEP = "as its input"
    COPY = "as its source (copy_)"
    ARITH = "constant when all tensor inputs are"
    ADD = "ARITH, and zeros plus a value of its own are ACC"
    JOIN = "zeros when every piece is, ACC when each is zeros or ACC (cat, stack)"
    LIFT = "a Python number made a tensor (torch.tensor(0.0))"


FILL_VALUE_POS = {"full": 1, "full_like": 1, "fill": 1, "new_full": 2, "scalar_tensor": 0}
_KEEPS_ZERO = {
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze",
    "expand", "slice", "select", "split", "split_with_sizes", "unbind", "clone", "detach",
    "alias", "_to_copy", "contiguous", "as_strided",
    "index_select", "gather", "index", "take", "repeat", "flip", "roll",  # pick input elements
}


def value_rule(name: str) -> ValueRule | None:
    """How the result's known value follows from the inputs' for aten op ``name`` (a base name)."""
    if name in arithmetic.ZERO_MAKERS:
        return ValueRule.ZERO
    if name in arithmetic.FILL_OPS:
        return ValueRule.FILL
    if name in _KEEPS_ZERO:
        return ValueRule.KEEP
    if name == "copy":
        return ValueRule.COPY
    if name in ("cat", "stack"):
        return ValueRule.JOIN
    if name in arithmetic.CONST_PRESERVING:
        return ValueRule.ADD if name == "add" else ValueRule.ARITH
    if name in ("lift_fresh", "lift_fresh_copy"):
        return ValueRule.LIFT
    return None


# The table. A key is an aten base name ("add" covers add.Tensor, add_.Scalar, add.out), a
# (namespace, name) of a collective, or an op (an OpOverload or OpOverloadPacket), which wins.
_TABLE: dict[Hashable, Rule] = {}
_ON_CHANGE: list[Callable[[], None]] = []


def _refine(refinement: Refinement) -> None:
    """Chain ``refinement`` onto its base: the named entry, else each op's own entry."""
    for op in refinement.ops:
        base = _TABLE[op if refinement.base is None else refinement.base]
        _TABLE[op] = functools.partial(refinement.rule, base)


def _build(by_name: Iterable[dict], families: Iterable[Any]) -> None:
    for table in by_name:
        _TABLE.update(table)
    for family in families:
        _TABLE.update(family.RULES_BY_OP)
        for refinement in family.REFINEMENTS:
            _refine(refinement)


_build((arithmetic.RULES, contraction.RULES, shape.RULES, indexing.RULES, collectives.RULES),
       (backward, norm_tracking, token_rows, gradient, sum_gradient))


def _own_name(func: Any) -> str:
    """An op's name without its overload (``add_.Tensor`` -> ``add_``)."""
    return func._opname if hasattr(func, "_opname") else func.__name__.split(".")[0]


def base_name(func: Any) -> str:
    """An op's name without overload and trailing underscore (``add_.Tensor`` -> ``add``)."""
    name = _own_name(func)
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _no_value(ctx: RuleContext, args, kwargs, out):
    """A profiler mark (``record_function``): no tensor value to type."""
    return NO_TENSOR


def rule_for(func: Any) -> Rule | None:
    """The rule that types ``func`` (an OpOverload), or None where there is none."""
    rule = _TABLE.get(func) or _TABLE.get(getattr(func, "overloadpacket", None))
    if rule is not None:
        return rule
    name = base_name(func)
    if func.namespace == "aten":
        return _TABLE.get(getattr(func, "_opname", name)) or _TABLE.get(name)
    if func.namespace == "profiler":
        return _no_value
    return _TABLE.get((func.namespace, _own_name(func)))


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever a rule is registered or unregistered (to drop resolved ops)."""
    _ON_CHANGE.append(callback)


def register_rule(op: Any, rule: Rule) -> None:
    """Type ``op`` (an OpOverload or OpOverloadPacket) with ``rule(ctx, args, kwargs, out)``."""
    _TABLE[op] = rule
    for callback in _ON_CHANGE:
        callback()


def unregister_rule(op: Any) -> None:
    """Drop the rule registered for ``op`` (see :func:`register_rule`)."""
    del _TABLE[op]
    for callback in _ON_CHANGE:
        callback()
