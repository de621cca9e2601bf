"""A parameter whose checkpoint layout is not how its module splits it across ranks.

The audit gives a sharded model and its one-rank reference the same global weights, each rank
its pieces as the model's own ``sharded_state_dict`` lays them out: the layout a distributed
checkpoint saves and reshards by. Where that layout and the module's own split of a parameter
disagree (GDN's ``in_proj.bias``: the layer splits it into its q, k, v, gate, beta and alpha
sections per rank like its weight, while ``sharded_state_dict`` splits only the weight), the
ranks hold other values than the reference, the numbers part ways, and the first op that
shows it is far from the cause.

:func:`mismatched_layout` asks each parameter whose gradient differs in turn: filled with one
value throughout in both runs (no layout of it can then change the forward), do fewer outputs
differ, and no forward value (loss, output, metric)? (All of them at once first, then halves.)
Its own gradient may still differ: the ranks' gradients are put together by the same layout.
A finding explained otherwise (a verified fix, a contracted call that differs, a collective on a
global group) is not asked: filling a weight with one value can hide a bug that is no layout's
(an output layer of one value makes every token's loss the same, whatever group sums them). That parameter's layout is the cause, located at the ``sharded_state_dict`` that makes it
(:func:`~shardcheck.megatron.scenarios.reference.layout_owner`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardcheck.megatron.audit.divergence import compute_dtype, output_gaps
from shardcheck.megatron.audit.outcome import Outcome
from shardcheck.megatron.audit.rank import UNIFORM, run_case
from shardcheck.megatron.audit.sweep import impl_of
from shardcheck.parity.layout import Layout
from shardcheck.parity.pool import PoolFailure

GRADIENT = "grad/"


@dataclass(frozen=True)
class LayoutMismatch:
    """A global key whose layout across ranks is the cause, and where that layout is made."""

    key: str
    owner: str | None  # ``file:line in Class.sharded_state_dict``, None where megatron-core's base makes it

    @property
    def location(self) -> str | None:
        """``file:line`` of the ``sharded_state_dict`` that lays it out."""
        return self.owner.split(" in ", 1)[0] if self.owner else None

    def title(self, layout: Layout) -> str:
        """The finding's title, in words."""
        made = self.owner.split(" in ", 1)[1] if self.owner else "sharded_state_dict"
        return (f"{self.key}: its checkpoint layout ({made}) is not how the layer splits "
                f"it across ranks, so a {layout} model given one rank's weights differs from one rank")


def mismatched_layout(pools: Any, outcome: Outcome) -> LayoutMismatch | None:
    """The parameter whose layout makes the case's outputs differ (see the module docstring), or
    None: no parameter is split across ranks, or filling every diverging gradient's parameter
    with one value leaves the outputs differing as they did. One such parameter is found by
    halving the set of candidates: a pair of runs (one rank, the layout) per half tried."""
    case = outcome.case
    if case.layout.tp == 1 and case.layout.ep == 1:
        return None
    before = {g.name for g in outcome.gaps}
    if not any(map(_forward, before)):
        return None
    keys = sorted(name.removeprefix(GRADIENT) for name in before if name.startswith(GRADIENT))
    owners = _repaired(pools, outcome, keys, before)
    if owners is None:
        return None
    while len(keys) > 1:  # the half that repairs it, else the other (checked when one is left)
        half = keys[:len(keys) // 2]
        owners = _repaired(pools, outcome, half, before)
        keys = half if owners is not None else keys[len(half):]
    owners = owners or _repaired(pools, outcome, keys, before)
    return LayoutMismatch(keys[0], owners[keys[0]]) if owners is not None else None


def _forward(name: str) -> bool:
    """Whether an output is a forward value (a loss, an output, a metric), not a gradient: every
    layout of a parameter the forward reads shows there."""
    return "grad" not in name


def _repaired(pools: Any, outcome: Outcome, keys: list[str], before: set[str]) -> dict[str, str | None] | None:
    """With ``keys`` filled with one value in both runs: where each one's layout is made, when
    fewer outputs differ and no forward value among them; else None."""
    case = outcome.case
    if not keys:
        return None
    fix = tuple(UNIFORM + key for key in keys)
    impl, dtype = impl_of(case.options, case.component), compute_dtype(case.options)
    try:
        [ref] = pools.run(Layout(), run_case, case.component, case.options, fix, False, impl=impl)
        ranks = pools.run(case.layout, run_case, case.component, case.options, fix, False, impl=impl)
    except PoolFailure:
        return None
    after = {g.name for g in output_gaps([r.outputs for r in ranks], ref.outputs, dtype)}
    if not after < before or any(map(_forward, after)):
        return None
    return {key: ref.owners.get(key) or ranks[0].owners.get(key) for key in keys}
