"""Gradient types: every typed parameter's gradient must fit the parameter's type.

The checker types the backward pass as it runs (backward kernels, collectives inside autograd
Functions, ``AccumulateGrad``'s writes into ``.grad``, in-place reductions of a flat
``main_grad`` buffer). This module names parameters, remembers how ``loss.backward()`` was
seeded, and checks each gradient against its parameter: explicitly with
:func:`check_gradients`, and automatically before every ``Optimizer.step`` in a typecheck region.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from shardcheck.typecheck import checker as _checker
from shardcheck.typecheck.gradient_rules import GradientFinding, gradient_finding
from shardcheck.typecheck.rules.gradient import gradient_of, gradient_state, report
from shardcheck.typecheck.types import Placement

ParamsLike = nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


_NAMES = WeakIdKeyDictionary()
"""Parameter -> name, for parameters named by annotate_parameters, check_gradients or a step."""


def parameter_name(param: torch.Tensor) -> str | None:
    return _NAMES.get(param)


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
        gradient_state(checker).name(named)
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


def check_gradients(model_or_params: ParamsLike, at: str | None = None) -> list[GradientFinding]:
    """Check every typed parameter's gradient; report (raise or collect) and return the findings.

    Must run inside ``sc.typecheck``. Parameters or gradients without a type are skipped.
    ``at``: the ``file:line`` to report them at (by default the caller's line).
    """
    checker = _checker.current()
    if checker is None:
        raise RuntimeError("shardcheck: call check_gradients inside `with sc.typecheck(mesh):`")
    findings = _findings(checker, _named(model_or_params))
    report(checker, findings, "check_gradients", at)
    return findings


def _findings(checker: _checker.Checker,
              named: list[tuple[str, torch.Tensor]]) -> list[GradientFinding]:
    state = gradient_state(checker)
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
