"""A parameter's ``allreduce`` declaration against the ranks its gradient must be summed over.

Megatron's DDP reduces each parameter's gradient in one of two kinds of buffer, chosen by the
parameter's ``allreduce`` attribute: ``True``, a dense buffer, summed over the DDP's data-parallel
(x cp) group; ``False``, an expert buffer, summed over its expert data-parallel group (the
expert grid's). A parameter declared for the wrong kind (#5916: the experts' linears at an
expert tp size other than tp's kept ``allreduce=True``) is summed over the wrong ranks; the
gradient norm and the step show it, far from the constructor that set the attribute.

:func:`check_reduction_groups`, in a checked run once the gradients are reduced, reports each
parameter whose gradient breaks its type (:func:`~shardcheck.typecheck.gradient_rules.gradient_finding`)
on a mesh axis whose ranks the other kind's group holds and its own kind's group does not, at
the megatron-core line that set its ``allreduce``. Left out: a parameter with
``sequence_parallel`` (``finalize_model_grads`` sums it over tp outside the buffers) and one cut
over a tensor-parallel group (its ranks hold other pieces: no buffer should sum over them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MISGROUPED = "gradient reduced over another group"
GROUPS = {True: "data-parallel", False: "expert data-parallel"}  # by allreduce: the DDP's groups


@dataclass(frozen=True)
class Misgrouped:
    """A parameter whose ``allreduce`` picks a buffer whose group misses an axis its gradient
    varies on (the shape of a gradient finding, for the checker's report)."""

    rule: str
    param: str
    axis: str
    allreduce: bool
    own: tuple[int, ...]
    along: tuple[int, ...]

    def describe(self) -> str:
        return (f"{self.param}: allreduce={self.allreduce} sums its gradient over the DDP's "
                f"{GROUPS[self.allreduce]} group (ranks {list(self.own)}), but it breaks its type on "
                f"{self.axis} (ranks {list(self.along)}), which only the {GROUPS[not self.allreduce]} "
                "group holds")

    @property
    def why(self) -> str:
        return "the gradient is summed in the other kind of buffer than the ranks that hold the parameter need"

    @property
    def fix(self) -> str:
        return f"declare {self.param} allreduce={not self.allreduce} where its layer is built"


def misgrouped_axes(allreduce: bool, broken: dict[str, set[int]], dense: set[int],
                    expert: set[int]) -> list[str]:
    """The axes of ``broken`` (each with its ranks) that the group ``allreduce`` does not pick
    (``dense`` for False, ``expert`` for True) holds, and the one it picks does not."""
    own, other = (dense, expert) if allreduce else (expert, dense)
    return [axis for axis, ranks in broken.items() if ranks <= other and not ranks <= own]


def check_reduction_groups(ddp: Any, sites: dict[int, str], keys: dict[int, str]) -> None:
    """In a checked run, report each parameter of ``ddp`` that :func:`misgrouped_axes` finds, at
    its ``allreduce`` declaration (``sites``, by parameter id: ``file:line in function`` in
    megatron-core), named by its global key (``keys``, by parameter id: the parameters to check)."""
    from shardcheck.typecheck.checker import current
    from shardcheck.typecheck.rules.gradient import report

    checker = current()
    if checker is None:
        return
    dense, expert = _ranks(ddp.intra_dp_cp_group), _ranks(ddp.intra_expt_dp_group)
    for param in ddp.module.parameters():
        if id(param) not in sites or id(param) not in keys or getattr(param, "sequence_parallel", False):
            continue
        allreduce, broken = bool(getattr(param, "allreduce", True)), _broken_axes(checker, param)
        own = tuple(sorted(dense if allreduce else expert))
        found = [Misgrouped(MISGROUPED, keys[id(param)], axis, allreduce, own, tuple(sorted(broken[axis])))
                 for axis in misgrouped_axes(allreduce, broken, dense, expert)]
        report(checker, found, "DistributedDataParallel", sites[id(param)].split(" in ", 1)[0])


def _broken_axes(checker: Any, param: torch.nn.Parameter) -> dict[str, set[int]]:
    """The mesh axes (with their ranks) on which ``param``'s gradient breaks its type."""
    from shardcheck.typecheck.gradient_rules import gradient_finding
    from shardcheck.typecheck.rules.gradient import gradient_of, gradient_state

    grad = gradient_of(param)
    declared, actual = checker.types(param), checker.types(grad) if grad is not None else None
    if declared is None or actual is None:
        return {}
    varies, constant = gradient_state(checker).loss_varies, checker.const(grad)
    return {axis: set(checker.mesh.axes[axis].ranks) for a, axis in enumerate(checker.names)
            if checker.sizes[a] > 1
            and gradient_finding("", axis, declared[a], actual[a], a in varies, constant) is not None}


def _ranks(group: Any) -> set[int]:
    return set(torch.distributed.get_process_group_ranks(group))
