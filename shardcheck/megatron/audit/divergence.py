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

import itertools
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardcheck.megatron.checks.contracts import BY_NAME, ProbeRecord
from shardcheck.megatron.checks.paths import megatron_path
from shardcheck.parity.assemble import tolerance
from shardcheck.parity.layout import BASE_DIMS, Layout
from shardcheck.parity.op_record import OpRecord

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


def _combine(axis: str, placement: str, parts: list[torch.Tensor], balanced: bool = True) -> torch.Tensor:
    if placement == "P":
        return torch.stack(parts).sum(0)
    if placement == "P(avg)":
        return torch.stack(parts).mean(0)
    if placement.startswith("S("):
        dim = int(placement[2:-1])
        return _load_balanced(parts, dim) if axis == "cp" and balanced else torch.cat(parts, dim)
    spreads = [(part - parts[0]).abs().max().item() if part.numel() else 0.0 for part in parts]
    return parts[spreads.index(max(spreads))]  # R: the replica most unlike the first


def _merged(values: dict[int, torch.Tensor], axis: str, placement: str,
            groups: Iterable[tuple[int, ...]], balanced: bool = True) -> dict[int, torch.Tensor]:
    """``values`` by rank with each group's members present combined into its first one
    (``balanced``: a cp shard in Megatron's load-balanced order, else in rank order)."""
    merged = dict(values)
    for group in groups:
        members = [r for r in group if r in values]
        if len(members) > 1:
            for rank in members:
                merged.pop(rank)
            merged[members[0]] = _combine(axis, placement, [values[r] for r in members], balanced)
    return merged


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
        values = _merged(values, axis, placement, _partition(axis, layout, records))
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


# ---- op calls ------------------------------------------------------------------------------

OP_AXES = ("tp", "cp", "ep", "dp", "pp")
_ASSEMBLED = re.compile(r"R|I|P|P\(avg\)|S\(-?\d+\)")  # placements a global value is rebuilt from


def assemble_op(layout: Layout, records: Mapping[int, OpRecord], position: int,
                balanced: bool = True) -> torch.Tensor | None:
    """The global value of output ``position`` of one op call recorded on ``records``' ranks,
    or None where its types cannot rebuild it.

    Per axis, the ranks present in one group are combined by their placement (all alike: R,
    I, P, P(avg) or S(d)); an axis on which no group holds two of them (a pipeline stage's op,
    run on that stage only) needs none. S(d) on cp says nothing of the pieces' order:
    ``balanced`` reads them in Megatron's load-balanced order (the batch's), else in rank order."""
    values = _rebuilt(layout, records, position, OP_AXES, balanced)
    return next(iter(values.values())) if values is not None and len(values) == 1 else None


def _rebuilt(layout: Layout, records: Mapping[int, OpRecord], position: int, axes: Iterable[str],
             balanced: bool = True) -> dict[int, torch.Tensor] | None:
    """Output ``position`` of ``records``' ranks with each group of each of ``axes`` combined by
    its placement into its first rank (see :func:`assemble_op`), or None where its types cannot."""
    values = {rank: rec.values[position] for rank, rec in records.items()}
    if any(v is None for v in values.values()):
        return None
    for axis in axes:
        groups = [g for g in layout.partition(axis) if sum(r in values for r in g) > 1]
        if not groups:
            continue
        kinds = {(records[r].placements[position] or {}).get(axis) for g in groups for r in g if r in values}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind is None or not _ASSEMBLED.fullmatch(kind) or not _fit(kind, list(values.values())):
            return None
        values = _merged(values, axis, "R" if kind == "I" else kind, groups, balanced)
    return values


def _fit(placement: str, parts: list[torch.Tensor]) -> bool:
    """Whether ``parts`` have the shapes ``placement`` combines: alike, or for S(d) alike but
    along ``d``."""
    shapes = {tuple(p.shape) for p in parts}
    if not placement.startswith("S(") or len(shapes) == 1:
        return len(shapes) == 1
    ndims = {len(shape) for shape in shapes}
    if len(ndims) != 1:
        return False
    dim = int(placement[2:-1]) % max(ndims.pop(), 1)
    return len({shape[:dim] + shape[dim + 1:] for shape in shapes}) == 1


_UNCOMPARED = object()  # an op output whose types do not rebuild it with the reference's shape


def _op_gap(name: str, layout: Layout, records: Mapping[int, OpRecord], position: int,
            expected: torch.Tensor, dtype: torch.dtype) -> Gap | None | object:
    """The gap of one op output rebuilt from the ranks' records (in the cp order that fits the
    reference best), None when within tolerance, ``_UNCOMPARED`` when not rebuilt with the
    reference's shape."""
    gaps = []
    for balanced in (True, False):
        value = assemble_op(layout, records, position, balanced)
        if value is None or value.shape != expected.shape:
            return _UNCOMPARED
        for ordered in _cp_orders(value, layout.cp):
            found = gap(name, ordered, expected, dtype=dtype)
            if found is None:
                return None
            gaps.append(found)
    return min(gaps, key=lambda g: g.max_error)


def _cp_orders(value: torch.Tensor, cp: int) -> Iterator[torch.Tensor]:
    """``value``, then (under cp) read back from Megatron's load-balanced order along each set of
    dims that it divides into 2 * cp chunks: a sequence gathered over cp is replicated in the
    ranks' order (attention's keys), which its type does not say."""
    yield value
    if cp < 2:
        return
    dims = [d for d in range(value.dim()) if value.shape[d] and value.shape[d] % (2 * cp) == 0]
    for n in range(1, len(dims) + 1):
        for chosen in itertools.combinations(dims, n):
            ordered = value
            for d in chosen:
                ordered = _load_balanced(list(ordered.chunk(cp, d)), d)
            yield ordered


@dataclass(frozen=True)
class OpGap:
    """The first op call whose rebuilt output differs from the one-rank run's."""

    site: str  # megatron/core/...py:NNN
    function: str
    op: str
    gap: Gap
    root: tuple[str, str] | None = None  # (site, function) that scaled its gradient (split_gradient_gap)

    @property
    def location(self) -> str:
        return self.root[0] if self.root is not None else self.site

    def line(self) -> str:
        """The finding's line: ``first op: FILE:LINE in FUNCTION: OP (max abs error E)``, and
        where its gradient was scaled, where that is elsewhere."""
        line = f"first op: {self.site} in {self.function}: {self.op} (max abs error {self.gap.max_error:.3g})"
        return line + (f"; its gradient scaled at {self.root[0]} in {self.root[1]}" if self.root else "")


def op_gaps(layout: Layout, per_rank: Sequence[Sequence[OpRecord]], reference: Sequence[OpRecord],
            dtype: torch.dtype = torch.float32, until: int | None = None) -> Iterator[tuple[OpRecord, Gap]]:
    """In the reference's order, each op call whose output rebuilt from the ranks' records
    (:func:`assemble_op`) differs from the one-rank run's, with its gap; with ``until``, among
    the reference's calls whose ``mark`` is at most ``until`` only (those made up to the end of
    the first diverging contracted call: an op after it is no nearer the cause than that call).

    Calls are aligned by key (call site, function, op, autograd node) and index; a key is
    compared only where every rank that made it made it as often as the reference (a site that
    runs differently under the layout, e.g. a layer loop cut into pipeline stages, is skipped),
    and an output only where it is rebuilt with the reference's shape. An op that differs is
    passed over where a later op on the ranks, in the same run of its function's lines (no
    other function's ops between), rebuilds to its one-rank value: Megatron computes some
    values in steps whose first is no global value under a layout
    (``aux_loss * num_local_tokens * cp_size``: the first product is each rank's share of
    another factoring; a vocab-parallel embedding looks up row 0 for the other ranks' tokens,
    then zeroes them on its next line, which one rank skips)."""
    counts = Counter(ref.key() for ref in reference)
    made = [Counter(rec.key() for rec in calls) for calls in per_rank]
    by_call = [{(rec.key(), rec.index): rec for rec in calls} for calls in per_rank]
    aligned = {key for key, count in counts.items() if all(m[key] in (0, count) for m in made)}
    positions = [{id(rec): n for n, rec in enumerate(calls)} for calls in per_rank]
    for ref in reference:
        if until is not None and ref.mark > until:
            return
        records = {rank: calls[(ref.key(), ref.index)] for rank, calls in enumerate(by_call)
                   if (ref.key(), ref.index) in calls}
        if ref.key() not in aligned or not records:
            continue
        for position, expected in enumerate(ref.values):
            if expected is None:
                continue
            found = _op_gap(f"{ref.op}#{ref.index}", layout, records, position, expected, dtype)
            if found is _UNCOMPARED:
                continue
            if found is not None and not _corrected_later(layout, per_rank, positions, records, expected, dtype):
                yield ref, found
            break


def _run(record: OpRecord) -> tuple[str, str, str]:
    return record.site.rsplit(":", 1)[0], record.function, record.backward


def _corrected_later(layout: Layout, per_rank: Sequence[Sequence[OpRecord]], positions: list[dict[int, int]],
                     records: Mapping[int, OpRecord], expected: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a later op on the ranks, in the same run of the function's lines (the same ops on
    every rank, none of another function between), rebuilds to ``expected``, the one-rank value."""
    run = _run(next(iter(records.values())))
    for step in itertools.count(1):
        later = {}
        for rank, rec in records.items():
            at = positions[rank][id(rec)] + step
            if at >= len(per_rank[rank]) or _run(per_rank[rank][at]) != run:
                return False
            later[rank] = per_rank[rank][at]
        if len({rec.key() for rec in later.values()}) != 1:
            return False
        values = next(iter(later.values())).values
        if any(v is not None and v.shape == expected.shape
               and _op_gap("", layout, later, position, expected, dtype) is None
               for position, v in enumerate(values)):
            return True
    return False


def first_op_gap(layout: Layout, per_rank: Sequence[Sequence[OpRecord]], reference: Sequence[OpRecord],
                 dtype: torch.dtype = torch.float32, until: int | None = None) -> OpGap | None:
    """The first of :func:`op_gaps`, or None."""
    for ref, found in op_gaps(layout, per_rank, reference, dtype, until):
        return OpGap(megatron_path(ref.site), ref.function, ref.describe().split(": ", 1)[1], found)
    return None


# ---- gradients under a split-free loss ---------------------------------------------------------

def split_gradient_gap(layout: Layout, per_rank: Sequence[Sequence[OpRecord]], reference: Sequence[OpRecord],
                       dtype: torch.dtype = torch.float32) -> OpGap | None:
    """The first gradient that depends on how the batch is split, where the one-rank reference
    took the whole batch in one micro-batch (a loss that promises not to depend on the split) and
    the ranks share it over dp, each micro-batch's value rebuilt from the tp ranks' pieces by
    their recorded types (:func:`_rebuilt`); None otherwise.

    The gradient of the loss with respect to one token's value does not depend on which rank or
    micro-batch holds the token, so a backward op's output summed over its batch dim (the one dim
    that the micro-batches cut, whose pieces add up to the reference's) equals the
    reference's sum of all pieces. The first that does not is named; where the gradient reached
    it through values reduced over a micro-batch (a loss term, scalars the ranks' shares cannot
    be compared by), the finding is located at the line, in the innermost function holding all
    the steps of that reduction's backward, of the step nearest the loss (:func:`_scaled_at`)."""
    if layout.world_size < 2 or layout.dp * layout.tp != layout.world_size or layout.ep > 1:
        return None
    counts = Counter(ref.key() for ref in reference)
    made = [Counter(rec.key() for rec in calls) for calls in per_rank]
    by_call = [{(rec.key(), rec.index): rec for rec in calls} for calls in per_rank]
    split = [_split(layout, ref, _pieces(ref, counts[ref.key()], made, by_call)) if ref.backward
             else _UNCOMPARED for ref in reference]
    for n, (ref, cut) in enumerate(zip(reference, split, strict=True)):
        if not isinstance(cut, tuple):
            continue
        expected, observed, scale = cut
        found = gap(f"{ref.op}#{ref.index}", observed, expected, RELATIVE * scale, dtype)
        if found is not None:
            return OpGap(megatron_path(ref.site), ref.function, ref.describe().split(": ", 1)[1], found,
                         _scaled_at(reference, split, n))
    return None


_Sums = tuple[torch.Tensor, torch.Tensor, float]  # reference's, pieces', scale of the terms


def _pieces(ref: OpRecord, count: int, made: list[Counter], by_call: list[dict]) -> list[dict[int, OpRecord]] | None:
    """The ranks' calls that hold ``ref``'s call's pieces, by micro-batch: the call of each rank
    in its ``j``-th micro-batch (a rank making ``count`` calls of the key per micro-batch); None
    when the ranks' calls are no whole and equal number of micro-batches."""
    key = ref.key()
    if any(m[key] == 0 or m[key] % count or m[key] != made[0][key] for m in made):
        return None
    return [{rank: calls[(key, ref.index + j * count)] for rank, calls in enumerate(by_call)}
            for j in range(made[0][key] // count)]


def _split(layout: Layout, ref: OpRecord, pieces: list[dict[int, OpRecord]] | None) -> _Sums | None | object:
    """For the first output of ``ref`` cut along a batch dim by ``pieces`` (each micro-batch's
    calls, rebuilt over tp by their types), the reference's and the pieces' sums over it and
    the scale of its terms; None where no output is cut so (a value reduced over the batch);
    ``_UNCOMPARED`` where the pieces do not align."""
    if not pieces:
        return _UNCOMPARED
    for position, expected in enumerate(ref.values):
        rebuilt = [] if expected is None else [_rebuilt(layout, calls, position, ("tp",)) for calls in pieces]
        if not rebuilt or any(values is None for values in rebuilt):
            continue
        parts = [part for values in rebuilt for part in values.values()]
        if any(part.dim() != expected.dim() for part in parts):
            continue
        cut = [d for d in range(expected.dim()) if any(part.shape[d] != expected.shape[d] for part in parts)]
        if len(cut) == 1 and sum(part.shape[cut[0]] for part in parts) == expected.shape[cut[0]]:
            d = cut[0]
            observed = torch.stack([part.double().sum(d) for part in parts]).sum(0)
            scale = expected.double().abs().sum(d).max().item() if expected.numel() else 0.0
            return expected.double().sum(d), observed, scale
    return None


def _scaled_at(reference: Sequence[OpRecord], split: Sequence[_Sums | None | object],
               first: int) -> tuple[str, str] | None:
    """Where the gradient that first parts ways (``reference[first]``) was scaled, when it came
    from a loss term through scalars (the backward steps of a reduction over a micro-batch, run
    just before it, that no batch dim cuts): the innermost megatron-core function whose forward
    call stack holds every such step, at its line that led to the step nearest the loss (the
    first to run backward). None when it came straight from a gradient the pieces compare (then
    the op itself is the root)."""
    steps = []
    for n in range(first - 1, -1, -1):
        ref = reference[n]
        if not ref.backward or split[n] is not None or not all(v is None or v.numel() == 1 for v in ref.values):
            break
        if ref.stack:
            steps.append(ref.stack)
    if not steps:
        return None
    depth = 0
    while all(len(s) > depth and _frame(s[depth]) == _frame(steps[0][depth]) for s in steps):
        depth += 1
    return (megatron_path(steps[-1][depth - 1][0]), steps[-1][depth - 1][1]) if depth else None


def _frame(entry: tuple[str, str]) -> tuple[str, str]:
    """A stack entry's file and function (its line aside)."""
    return entry[0].rsplit(":", 1)[0], entry[1]
