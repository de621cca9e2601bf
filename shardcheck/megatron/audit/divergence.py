"""Where a multi-rank run parts ways with the one-rank run: its outputs, and its contracted calls.

Outputs of the Megatron catalogue are global values, replicated on every rank: each rank's
value is compared with the reference. Contracted calls (see :mod:`shardcheck.megatron.checks.contracts`)
are rebuilt into global values from their ``ensures`` placements first.

Tolerance: ``max(assemble.tolerance(reference), RELATIVE * max|reference|)``. The floor of
``RELATIVE = 1e-4`` (parity's cap) absorbs float32 reassociation over a whole training step:
the correct layouts stay below 1e-5, but a differently fused kernel (e.g. the fused
cross-entropy) reorders sums by up to ~5e-5 of the largest gradient. An error of 1e-3
relative is always reported. Weights after an
optimizer step get ``STEP_RELATIVE``: Adam's first step moves each weight by about ``lr``
whatever the gradient's size, so a gradient that rounds across zero moves its weight the
other way; such weights are reported through their gradients instead. Every value is also
allowed ``FAMILY_RELATIVE = 1e-6
# In bf16 or fp16 a correct layout differs from one rank by rounding in that precision: up to
# 2 eps (relative to each value's largest magnitude) on the tiny GPT; a finding needs 6.
HALF_EPS = 6.0`` of the largest magnitude among the outputs of its family
(``grad/...``, ``param/...``): a gradient that is zero in exact arithmetic is pure rounding
noise, with no scale of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardcheck.megatron.checks.contracts import BY_NAME, ProbeRecord
from shardcheck.parity.assemble import tolerance
from shardcheck.parity.layout import BASE_DIMS, Layout

RELATIVE = 1e-4
STEP_RELATIVE = 5e-2
FAMILY_RELATIVE = 1e-6
# In bf16 or fp16 a correct layout differs from one rank by rounding in that precision: up to
# 2 eps (relative to each value's largest magnitude) on the tiny GPT; a finding needs 6.
HALF_EPS = 6.0


@dataclass(frozen=True)
class Gap:
    """One value that differs from its reference."""

    name: str
    observed: float | list
    reference: float | list
    max_error: float
    relative: float
    tol: float

    def summary(self) -> str:
        return (f"{self.name}: observed {_show(self.observed)} vs reference {_show(self.reference)} "
                f"(max abs err {self.max_error:.3g}, rel {self.relative:.3g})")


def _show(value: float | list) -> str:
    if isinstance(value, list):
        flat = torch.tensor(value, dtype=torch.float64).flatten()
        head = ", ".join(f"{v:.6g}" for v in flat[:4].tolist())
        return f"[{head}{', ...' if flat.numel() > 4 else ''}]"
    return f"{value:.6g}"


def _numbers(value: torch.Tensor) -> float | list:
    return value.item() if value.numel() == 1 else value.tolist()


def _tolerance(name: str, reference: torch.Tensor, floor: float, dtype: torch.dtype = torch.float32) -> float:
    scale = reference.abs().max().item() if reference.numel() else 0.0
    relative = STEP_RELATIVE if name.startswith("param/") else max(RELATIVE, HALF_EPS * _eps(dtype))
    return max(tolerance(reference, 0.0, torch.float32), relative * scale, floor)


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def compute_dtype(options: Iterable[tuple[str, Any]]) -> torch.dtype:
    """The precision a case computes in: bf16 or fp16 when its options ask for it, else fp32."""
    chosen = dict(options)
    return torch.bfloat16 if chosen.get("bf16") else torch.float16 if chosen.get("fp16") else torch.float32


def family_floors(reference: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Per output, ``FAMILY_RELATIVE`` times the largest magnitude among outputs of its family
    (the same prefix, e.g. every ``grad/``): a value that is zero in exact arithmetic (e.g. the
    gradient of a bias a softmax cannot see) is rounding noise at its family's scale."""
    scales: dict[str, float] = {}
    for name, value in reference.items():
        family = name.split("/", 1)[0] if "/" in name else name
        if value.numel():
            scales[family] = max(scales.get(family, 0.0), value.abs().max().item())
    relative = max(FAMILY_RELATIVE, _eps(dtype)) if dtype != torch.float32 else FAMILY_RELATIVE
    return {name: relative * scales.get(name.split("/", 1)[0] if "/" in name else name, 0.0)
            for name in reference}


def gap(name: str, observed: torch.Tensor, reference: torch.Tensor, floor: float = 0.0,
        dtype: torch.dtype = torch.float32) -> Gap | None:
    """The gap between two values of one name, or None when within tolerance."""
    if observed.shape != reference.shape:
        return Gap(name, list(observed.shape), list(reference.shape), float("inf"), float("inf"), 0.0)
    if not reference.numel():
        return None
    error = (observed.double() - reference.double()).abs().max().item()
    tol = _tolerance(name, reference, floor, dtype)
    if error <= tol and error == error:
        return None
    scale = reference.abs().max().item()
    return Gap(name, _numbers(observed), _numbers(reference), error, error / scale if scale else error, tol)


def output_gaps(per_rank: Sequence[Mapping[str, torch.Tensor]],
                reference: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> list[Gap]:
    """Outputs that differ from the reference on some rank (the worst rank's value per name),
    at the tolerance of the precision the case computes in (``dtype``)."""
    gaps: list[Gap] = []
    floors = family_floors(reference, dtype)
    for name, ref in reference.items():
        found = [g for outputs in per_rank if name in outputs
                 and (g := gap(name, outputs[name], ref, floors[name], dtype)) is not None]
        if found:
            gaps.append(max(found, key=lambda g: g.max_error))
    return gaps


def max_errors(per_rank: Sequence[Mapping[str, torch.Tensor]],
               reference: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per output, the largest absolute difference from the reference over the ranks."""
    errors: dict[str, float] = {}
    for name, ref in reference.items():
        diffs = [(outputs[name].double() - ref.double()).abs().max().item() for outputs in per_rank
                 if name in outputs and outputs[name].shape == ref.shape and ref.numel()]
        errors[name] = max(diffs, default=float("inf") if ref.numel() else 0.0)
    return errors


# ---- contracted calls --------------------------------------------------------------------

def _load_balanced(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Undo Megatron's CP split: rank r holds chunks r and 2*cp-1-r of the sequence."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim)
        chunks[rank], chunks[2 * cp - 1 - rank] = first, second
    return torch.cat(chunks, dim)  # type: ignore[arg-type]


def _combine(axis: str, placement: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if placement == "P":
        return torch.stack(parts).sum(0)
    if placement == "P(avg)":
        return torch.stack(parts).mean(0)
    if placement.startswith("S("):
        dim = int(placement[2:-1])
        return _load_balanced(parts, dim) if axis == "cp" else torch.cat(parts, dim)
    spreads = [(part - parts[0]).abs().max().item() if part.numel() else 0.0 for part in parts]
    return parts[spreads.index(max(spreads))]  # R: the replica most unlike the first


def _partition(axis: str, layout: Layout, records: Mapping[int, ProbeRecord]) -> list[tuple[int, ...]]:
    if axis.startswith("group:"):
        arg = axis.split(":", 1)[1]
        return sorted({r.groups[arg] for r in records.values() if arg in r.groups})
    return layout.partition(axis) if axis in BASE_DIMS else []


def assemble_result(layout: Layout, records: Mapping[int, ProbeRecord], position: int,
                    ensures: Mapping[str, str]) -> torch.Tensor | None:
    """The global value of result ``position`` of one call, or None when its types don't cover the layout.

    Axes are combined in the order ``ensures`` lists them; R keeps the replica most unlike the
    first, so that a broken replica shows as a gap.
    """
    values = {rank: rec.results[position] for rank, rec in records.items()}
    if any(v is None for v in values.values()):
        return None
    for axis, placement in ensures.items():
        merged = dict(values)
        for group in _partition(axis, layout, records):
            members = [r for r in group if r in values]
            if len(members) > 1:
                for rank in members:
                    merged.pop(rank)
                merged[members[0]] = _combine(axis, placement, [values[r] for r in members])
        values = merged
    return next(iter(values.values())) if len(values) == 1 else None


@dataclass(frozen=True)
class CallGap:
    """The first contracted call whose rebuilt result differs from the one-rank run."""

    contract: str
    call: int
    gap: Gap


def first_call_gap(layout: Layout, per_rank: Sequence[Sequence[ProbeRecord]],
                   reference: Sequence[ProbeRecord], dtype: torch.dtype = torch.float32) -> CallGap | None:
    """In the reference's call order, the first contracted result that diverges.

    A contract's calls are compared only when every rank made as many of them as the reference:
    otherwise the n-th calls are not the same call (e.g. under expert parallelism Megatron's
    optimizer computes the gradient norm of dense and expert parameters separately)."""
    counts = Counter(ref.contract for ref in reference)
    aligned = {name for name, count in counts.items()
               if all(sum(rec.contract == name for rec in calls) == count for calls in per_rank)}
    for ref in reference:
        ensures = BY_NAME[ref.contract].ensures
        if not ensures or ref.contract not in aligned:
            continue
        records = {rank: rec for rank, calls in enumerate(per_rank) for rec in calls
                   if rec.contract == ref.contract and rec.index == ref.index}
        if len(records) != len(per_rank):
            continue
        for position, (result_name, types) in enumerate(ensures):
            if position >= len(ref.results) or ref.results[position] is None:
                continue
            value = assemble_result(layout, records, position, types)
            if value is None:
                continue
            found = gap(f"{ref.contract}#{ref.index}.{result_name}", value, ref.results[position],
                        dtype=dtype)
            if found is not None:
                return CallGap(ref.contract, ref.index, found)
    return None
