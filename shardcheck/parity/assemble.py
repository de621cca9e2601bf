"""Rebuild a global value from the ranks' local values by its placements, and compare it with a reference.

Per axis of size > 1, ranks that differ only on that axis are combined: S(d) concatenates
along d, P sums, R and I check that the replicas agree and keep one, V over ``dp`` is the
rank's slice of the batch (dim 0), so it concatenates along 0. Axes whose placement is not
known are inferred: every choice of R, P and S(d) that gives the reference's shape is tried and
the one closest to the reference wins (R before P before S on ties). P is only inferred where
the ranks' values differ: equal values read as partial would hide a value off by the axis size.

Tolerance (see docs/parity.md): with ``eps`` the dtype's machine epsilon, ``scale`` the
largest magnitude of the reference and ``noise`` the largest change of the reference when its
inputs are perturbed by a few ``eps``::

    tol = min(max(32 * eps * scale, 4 * noise), max(1e-4, 64 * eps) * scale)

The floor absorbs float reassociation (a sum split across ranks), the noise term widens it for
ill-conditioned values, and the cap keeps any fp32 error of 1e-3 relative to the value's
magnitude a mismatch.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shardcheck.parity.layout import BASE_DIMS, Layout
from shardcheck.typecheck.types import P, Placement, R, S, Shard, V

NOISE_FACTOR = 4.0
FLOOR_EPS = 32.0
CAP_RELATIVE = 1e-4


class NotComparable(ValueError):
    """The placements give no global value to compare (e.g. V on a model-parallel axis)."""


@dataclass
class Comparison:
    """How one assembled value compares with the reference."""

    placements: dict[str, Placement]
    inferred: set[str]
    max_abs: float
    max_rel: float
    tol: float
    replica_diff: dict[str, float]

    @property
    def replica_mismatch(self) -> dict[str, float]:
        return {axis: diff for axis, diff in self.replica_diff.items() if diff > self.tol}

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tol and not self.replica_mismatch


def tolerance(reference: torch.Tensor, noise: float, dtype: torch.dtype) -> float:
    """The absolute tolerance for a value of ``dtype`` whose reference is ``reference``."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    scale = reference.abs().max().item() if reference.numel() else 0.0
    if scale == 0.0:
        return max(eps, NOISE_FACTOR * noise)
    return min(max(FLOOR_EPS * eps * scale, NOISE_FACTOR * noise), max(CAP_RELATIVE, 64 * eps) * scale)


def _combine(axis: str, placement: Placement, parts: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """Combine one group's values on ``axis``; also return how far replicas disagree."""
    if isinstance(placement, Shard):
        return torch.cat(parts, placement.dim), 0.0
    if placement is P:
        return torch.stack(parts).sum(0), 0.0
    if placement is V:
        if axis != "dp":
            raise NotComparable(f"V on {axis} has no global value")
        return torch.cat(parts, 0), 0.0
    diff = max((part - parts[0]).abs().max().item() for part in parts) if parts[0].numel() else 0.0
    return parts[0], diff


def assemble(values: Sequence[torch.Tensor], layout: Layout,
             placements: Mapping[str, Placement]) -> tuple[torch.Tensor, dict[str, float]]:
    """The global value (float64) of per-rank ``values`` and the replica disagreement per axis."""
    items = {rank: value.double() for rank, value in enumerate(values)}
    replica_diff: dict[str, float] = {}
    for axis in _axes(layout):
        merged = {}
        for group in layout.partition(axis):
            if group[0] in items:
                merged[group[0]], diff = _combine(axis, placements[axis], [items[r] for r in group])
                replica_diff[axis] = max(replica_diff.get(axis, 0.0), diff)
        items = merged
    return items[0], replica_diff


def _axes(layout: Layout) -> list[str]:
    return [axis for axis in BASE_DIMS if layout.size(axis) > 1]


def _global_shape(shape: Sequence[int], layout: Layout, placements: Mapping[str, Placement]) -> list[int]:
    shape = list(shape)
    for axis, placement in placements.items():
        dim = placement.dim if isinstance(placement, Shard) else 0 if placement is V and axis == "dp" else None
        if dim is not None:
            if not -len(shape) <= dim < len(shape):
                return []
            shape[dim] *= layout.size(axis)
    return shape


def _candidates(ndim: int) -> list[Placement]:
    return [R, P, *(S(d) for d in range(ndim))]


def compare(values: Sequence[torch.Tensor], reference: torch.Tensor, noise: float, layout: Layout,
            known: Mapping[str, Placement]) -> Comparison:
    """Assemble ``values`` (inferring unknown placements) and compare with ``reference``."""
    axes = _axes(layout)
    fixed = {axis: known[axis] for axis in axes if axis in known}
    open_axes = [axis for axis in axes if axis not in fixed]
    tol = tolerance(reference, noise, values[0].dtype)
    reference = reference.double()
    agree = {axis for axis in open_axes if _replicas_agree(values, layout, axis, tol)}
    best: Comparison | None = None
    for choice in itertools.product(_candidates(values[0].dim()), repeat=len(open_axes)):
        placements = {**fixed, **dict(zip(open_axes, choice, strict=True))}
        if any(placements[axis] is P for axis in agree):
            continue
        if _global_shape(values[0].shape, layout, placements) != list(reference.shape):
            continue
        try:
            value, replica = assemble(values, layout, placements)
        except (NotComparable, RuntimeError):
            continue
        err = (value - reference).abs().max().item() if value.numel() else 0.0
        scale = reference.abs().max().item() if reference.numel() else 0.0
        found = Comparison(placements, set(open_axes), err, err / scale if scale else err, tol, replica)
        if best is None or _score(found) < _score(best):
            best = found
    if best is None:
        raise NotComparable(_why_not(values[0], reference, layout, fixed))
    return best


def _replicas_agree(values: Sequence[torch.Tensor], layout: Layout, axis: str, tol: float) -> bool:
    """Whether ranks that differ only on ``axis`` hold the same value (within ``tol``)."""
    for group in layout.partition(axis):
        first = values[group[0]]
        for rank in group[1:]:
            if values[rank].shape != first.shape:
                return False
            if first.numel() and (values[rank].double() - first.double()).abs().max().item() > tol:
                return False
    return True


def _score(comparison: Comparison) -> float:
    return max(comparison.max_abs, *comparison.replica_diff.values(), 0.0)


def _why_not(local: torch.Tensor, reference: torch.Tensor, layout: Layout,
             fixed: Mapping[str, Placement]) -> str:
    if any(p is V and axis != "dp" for axis, p in fixed.items()):
        return "varying (V) on a model-parallel axis: no global value"
    declared = ", ".join(f"{a}={p}" for a, p in fixed.items()) or "none declared"
    return (f"local shape {list(local.shape)} cannot make the reference shape "
            f"{list(reference.shape)} under {layout} ({declared})")

