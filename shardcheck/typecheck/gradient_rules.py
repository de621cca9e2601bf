"""What a parameter's gradient type must be, given the parameter's type, per mesh axis.

Pure functions over placements, so every row of the table is unit-testable without ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardcheck.typecheck.types import I, P, Placement, R, Shard, V

UNREDUCED = "unreduced gradient"
MISDECLARED = "misdeclared parameter"
MISMATCH = "gradient type mismatch"

WHY = {
    UNREDUCED: "each rank holds only its contribution to the gradient; the optimizer needs their sum",
    MISDECLARED: "the parameter is declared replicated but its gradient differs per rank, so it "
                 "is really sharded and every replicated-parameter code path (norms, checkpoints, "
                 "all-reduces) treats it wrongly",
    MISMATCH: "the optimizer would update the parameter's shard with a gradient laid out differently",
}


@dataclass(frozen=True)
class GradientFinding:
    """One parameter's gradient breaks its type on one axis."""

    rule: str
    param: str
    axis: str
    param_type: Placement
    grad_type: Placement
    fix: str

    def describe(self) -> str:
        return (f"{self.param}: parameter {self.param_type!r} on {self.axis}, "
                f"gradient {self.grad_type!r}")

    @property
    def why(self) -> str:
        return WHY[self.rule]


def _is_replicated(p: Placement) -> bool:
    return p is R or p is I


def _is_partial(p: Placement) -> bool:
    return p is P or p.symbol.startswith("P")


def gradient_finding(param: str, axis: str, param_type: Placement | None,
                     grad_type: Placement | None, loss_varies: bool,
                     grad_constant: bool = False) -> GradientFinding | None:
    """The broken rule for one parameter on one axis, or None when the gradient fits.

    ``loss_varies``: a loss seeded ``backward()`` while V on this axis (data-parallel
    semantics), so a V gradient there is a per-rank contribution still to be reduced.
    ``grad_constant``: every element of the gradient is known to be the same (or zero), so an
    R or S layout fits either parameter layout.
    """
    if param_type is None or grad_type is None or not (
            _is_replicated(param_type) or isinstance(param_type, Shard)):
        return None
    if grad_type == param_type or (_is_replicated(param_type) and _is_replicated(grad_type)):
        return None
    if grad_constant and (_is_replicated(grad_type) or isinstance(grad_type, Shard)):
        return None

    def found(rule: str, fix: str) -> GradientFinding:
        return GradientFinding(rule, param, axis, param_type, grad_type, fix)

    reduce_fix = f"all_reduce {param}'s gradient over {axis} before the optimizer step"
    if _is_partial(grad_type) or (grad_type is V and loss_varies):
        return found(UNREDUCED, reduce_fix)
    if _is_replicated(param_type) and (grad_type is V or isinstance(grad_type, Shard)):
        dim = f"S({grad_type.dim})" if isinstance(grad_type, Shard) else "sharded (S(d))"
        return found(MISDECLARED, f"declare {param} {dim} on {axis} (Megatron: "
                                  "tensor_model_parallel=True with its partition_dim)")
    return found(MISMATCH, f"make {param}'s gradient {param_type!r} on {axis}")
