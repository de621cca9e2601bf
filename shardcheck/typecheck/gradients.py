"""Gradient types: every typed parameter's gradient must fit the parameter's type.

The checker types the backward pass as it runs (backward kernels, collectives inside autograd
Functions, ``AccumulateGrad``'s writes into ``.grad``, in-place reductions of a flat
``main_grad`` buffer). This module names parameters, remembers how ``loss.backward()`` was
seeded, and checks each gradient against its parameter: explicitly with
:func:`check_gradients`, and automatically before every ``Optimizer.step`` in a typecheck region.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from shardcheck.typecheck import checker as _checker
from shardcheck.typecheck.gradient_rules import GradientFinding, gradient_finding
from shardcheck.typecheck.types import Placement, V

ParamsLike = nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class GradientViolation(_checker.ViolationRecord):
    """A recorded gradient or norm-accounting violation, with the parameter (and axis) it names."""

    param: str = ""


@dataclass
class _GradientState:
    """Per typecheck region: axes a seeded loss varied on, findings already reported, and the
    parameters named in this region (what norm accounting follows; every rank of an SPMD
    program names the same ones, so the decision to exchange counts is the same on all)."""

    loss_varies: set[int] = field(default_factory=set)
    reported: set[tuple[str, str, str, str]] = field(default_factory=set)
    named: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)


_NAMES = WeakIdKeyDictionary()
"""Parameter -> name, for parameters named by annotate_parameters, check_gradients or a step."""


def _state(checker: _checker.Checker) -> _GradientState:
    checker = getattr(checker, "_checker", checker)  # a rule re-run sees the checker wrapped
    state = getattr(checker, "_gradient_state", None)  # read at every op of a norm's rules
    if state is None:
        state = checker._gradient_state = _GradientState()
    return state


def parameter_name(param: torch.Tensor) -> str | None:
    return _NAMES.get(param)


def has_named_parameters(checker: _checker.Checker) -> bool:
    return len(_state(checker).named) > 0


def named_parameters(checker: _checker.Checker) -> list[tuple[str, torch.Tensor]]:
    """The live parameters named in ``checker``'s region."""
    return [(name, p) for p, name in _state(checker).named.items()]


def _named(params: ParamsLike) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, nn.Module):
        pairs = list(params.named_parameters())
    elif isinstance(params, Mapping):
        pairs = list(params.items())
    else:
        pairs = [p if isinstance(p, tuple) else (parameter_name(p), p) for p in params]
    named = []
    for i, (name, p) in enumerate(pairs):
        if name is None:
            name = f"parameter {i} {tuple(p.shape)}"
        _NAMES[p] = name
        named.append((name, p))
    checker = _checker.current()
    if checker is not None:
        _state(checker).named.update((p, name) for name, p in named)
    return named


def annotate_parameters(model: ParamsLike,
                        types: Mapping[str, Mapping[str, Placement | str]] | None = None,
                        **default: Placement | str) -> ParamsLike:
    """Name every parameter of ``model`` and declare its placements; returns ``model``.

    ``default`` applies to every parameter (e.g. ``dp=sc.R``); ``types`` maps a parameter
    name or glob pattern (``"*.norm.weight"``) to {axis: placement} and wins over ``default``.
    Call it inside ``sc.typecheck``. Parameters left unannotated stay unknown.
    """
    for name, param in _named(model):
        spec = dict(default)
        for pattern, placements in (types or {}).items():
            if fnmatchcase(name, pattern):
                spec.update(placements)
        if spec:
            _checker.annotate(param, **spec)
    return model


def gradient_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer will use: Megatron's ``main_grad`` if set, else ``.grad``."""
    main = getattr(param, "main_grad", None)
    return main if isinstance(main, torch.Tensor) else param.grad


def check_gradients(model_or_params: ParamsLike) -> list[GradientFinding]:
    """Check every typed parameter's gradient; report (raise or collect) and return the findings.

    Must run inside ``sc.typecheck``. Parameters or gradients without a type are skipped.
    """
    checker = _checker.current()
    if checker is None:
        raise RuntimeError("shardcheck: call check_gradients inside `with sc.typecheck(mesh):`")
    findings = _findings(checker, _named(model_or_params))
    report(checker, findings, "check_gradients")
    return findings


def _findings(checker: _checker.Checker,
              named: list[tuple[str, torch.Tensor]]) -> list[GradientFinding]:
    state = _state(checker)
    findings = []
    for name, param in named:
        grad = gradient_of(param)
        declared = checker.types(param)
        actual = checker.types(grad) if grad is not None else None
        if declared is None or actual is None:
            continue
        constant = checker.const(grad)
        for a, axis in enumerate(checker.names):
            if checker.sizes[a] == 1:
                continue  # one rank holds the whole value: nothing to reduce or to shard
            found = gradient_finding(name, axis, declared[a], actual[a], a in state.loss_varies,
                                     constant)
            if found is not None:
                findings.append(found)
    return findings


def _message(finding, location: str, op: str) -> str:
    return "\n".join([
        f"checker: {finding.rule} at {location} in {op}: {finding.describe()}",
        f"  why: {finding.why}",
        f"  fix: {finding.fix}",
    ])


def report(checker: _checker.Checker, findings: list, op: str) -> None:
    """Raise the first finding (listing the rest), or record each new one in collect mode.

    A finding has ``rule``, ``param``, ``axis``, ``why``, ``fix`` and ``describe()``.
    """
    if not findings:
        return
    location = _checker.user_location()
    if checker.mode == "raise":
        first = findings[0]
        also = [f"  also: {f.rule}: {f.describe()}" for f in findings[1:]]
        message = "\n".join([_message(first, location, op), *also])
        raise _checker.SpmdTypeError(message, first.rule, location, op)
    seen = _state(checker).reported
    for f in findings:
        key = (location, f.rule, f.param, f.axis)
        if key not in seen:
            seen.add(key)
            checker.records.append(GradientViolation(
                f.rule, location, op, _message(f, location, op), axis=f.axis, param=f.param))


# --- automatic check before every optimizer step ----------------------------------------------

def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[tuple[str | None, torch.Tensor]]:
    pairs = []
    for group in optimizer.param_groups:
        names = group.get("param_names") or [None] * len(group["params"])
        pairs += [(name or parameter_name(p), p) for name, p in zip(names, group["params"], strict=True)]
    return pairs


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    checker = _checker.current()
    if checker is None or not checker.check_gradients_on_step:
        return
    report(checker, _findings(checker, _named(_optimizer_params(optimizer))), "optimizer.step")


register_optimizer_step_pre_hook(_before_step)


# --- the seed of loss.backward() ------------------------------------------------------------

_ones_like = _checker.RULES["ones_like"]


def _seed_rule(ctx, args, kwargs, out):
    """``backward()`` seeds with ``ones_like(loss, memory_format=preserve_format)``.

    A loss that is V on an axis (per-rank batches) makes V gradients there per-rank
    contributions that a data-parallel all-reduce must still sum or average.
    """
    loss = args[0]
    if "memory_format" in kwargs and loss.requires_grad:
        pl = ctx.types(loss)
        if pl is not None:
            _state(ctx).loss_varies.update(a for a, p in enumerate(pl) if p is V)
    return _ones_like(ctx, args, kwargs, out)


_checker.register_rule(torch.ops.aten.ones_like, _seed_rule)
