"""The gradient state of a typecheck region (the parameters named in it, the axes a seeded loss
varied on, the findings reported), how a gradient finding is reported, and the rule for the
seed of ``loss.backward()``. :mod:`shardcheck.typecheck.gradients` checks gradients with it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardcheck.typecheck.locations import user_location
from shardcheck.typecheck.rules.common import Refinement, RuleContext
from shardcheck.typecheck.types import V
from shardcheck.typecheck.violations import SpmdTypeError, ViolationRecord


@dataclass(frozen=True)
class GradientViolation(ViolationRecord):
    """A recorded gradient or norm-accounting violation, with the parameter (and axis) it names."""

    param: str = ""


@dataclass
class GradientState:
    """Per typecheck region: axes a seeded loss varied on, findings already reported, and the
    parameters named in this region (what norm accounting follows; every rank of an SPMD
    program names the same ones, so the decision to exchange counts is the same on all)."""

    loss_varies: set[int] = field(default_factory=set)
    reported: set[tuple[str, str, str, str]] = field(default_factory=set)
    named: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    # (namings, entries) when made, and (name, weak reference) per named parameter: a norm
    # compares its operand with every gradient, and listing the weak dict costs 1 µs an entry
    _listed: tuple = ((-1, -1), ())
    _namings: int = 0

    def name(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Name ``named``'s parameters (a name given again replaces the old one)."""
        self.named.update((p, name) for name, p in named)
        self._namings += 1

    def parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The live named parameters, in naming order."""
        made, listed = self._listed
        if made != (self._namings, len(self.named)):  # named since, or a parameter died
            listed = [(name, weakref.ref(p)) for p, name in self.named.items()]
            self._listed = ((self._namings, len(self.named)), listed)
        return [(name, p) for name, ref in listed if (p := ref()) is not None]


def gradient_state(checker: Any) -> GradientState:
    checker = getattr(checker, "_checker", checker)  # a rule re-run sees the checker wrapped
    state = getattr(checker, "_gradient_state", None)  # read at every op of a norm's rules
    if state is None:
        state = checker._gradient_state = GradientState()
    return state


def has_named_parameters(checker: Any) -> bool:
    return len(gradient_state(checker).named) > 0


def named_parameters(checker: Any) -> list[tuple[str, torch.Tensor]]:
    """The live parameters named in ``checker``'s region."""
    return gradient_state(checker).parameters()


def gradient_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer will use: Megatron's ``main_grad`` if set, else ``.grad``."""
    main = getattr(param, "main_grad", None)
    return main if isinstance(main, torch.Tensor) else param.grad


def _message(finding, location: str, op: str) -> str:
    return "\n".join([
        f"checker: {finding.rule} at {location} in {op}: {finding.describe()}",
        f"  why: {finding.why}",
        f"  fix: {finding.fix}",
    ])


def report(checker: Any, findings: list, op: str, location: str | None = None) -> None:
    """Raise the first finding (listing the rest), or record each new one in collect mode, at
    ``location`` (by default the calling user line).

    A finding has ``rule``, ``param``, ``axis``, ``why``, ``fix`` and ``describe()``.
    """
    if not findings:
        return
    location = location or user_location()
    if checker.mode == "raise":
        first = findings[0]
        also = [f"  also: {f.rule}: {f.describe()}" for f in findings[1:]]
        message = "\n".join([_message(first, location, op), *also])
        raise SpmdTypeError(message, first.rule, location, op)
    seen = gradient_state(checker).reported
    for f in findings:
        key = (location, f.rule, f.param, f.axis)
        if key not in seen:
            seen.add(key)
            checker.records.append(GradientViolation(
                f.rule, location, op, _message(f, location, op), axis=f.axis, param=f.param))


def _seed_rule(ones_like, ctx: RuleContext, args, kwargs, out):
    """``backward()`` seeds with ``ones_like(loss, memory_format=preserve_format)``.

    A loss that is V on an axis (per-rank batches) makes V gradients there per-rank
    contributions that a data-parallel all-reduce must still sum or average.
    """
    loss = args[0]
    if "memory_format" in kwargs and loss.requires_grad:
        pl = ctx.types(loss)
        if pl is not None:
            gradient_state(ctx).loss_varies.update(a for a, p in enumerate(pl) if p is V)
    return ones_like(ctx, args, kwargs, out)


RULES_BY_OP: dict = {}
REFINEMENTS = (Refinement((torch.ops.aten.ones_like,), _seed_rule, "ones_like"),)
