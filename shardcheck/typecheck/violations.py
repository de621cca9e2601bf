"""What a rule reports (:class:`Violation`), the ``HELP`` (why, fix) line per rule, and what the
checker makes of a report: an :class:`SpmdTypeError` raised or a :class:`ViolationRecord` kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Violation(Exception):
    """A rule's verdict: ``rule`` broken on mesh axis ``axis`` (an index)."""

    def __init__(self, rule: str, axis: int, why: str = "", occurrence: int | None = None,
                 unconfirmed: bool = False) -> None:
        super().__init__(rule)
        self.rule, self.axis, self.why, self.occurrence = rule, axis, why, occurrence
        # a report that stands only when ranks at two or more coordinates make it (see
        # checker.confirmed_across_ranks): recorded, never raised by one rank alone
        self.unconfirmed = unconfirmed


HELP: dict[str, tuple[str, str]] = {
    "non-linear on partial": (
        "the op is not linear: applied to each rank's partial sum it differs from the op of the sum",
        "all_reduce over {axis} before {op}"),
    "affine on partial": (
        "adding a non-zero replicated/sharded value to a partial sum adds it once per rank",
        "all_reduce over {axis} first, or add the term on one rank only"),
    "partial product": (
        "a product of per-rank partial sums is not the product of the sums",
        "all_reduce over {axis} one of the operands first"),
    "division by partial": (
        "each rank divides by its own partial of the divisor, not by the global value",
        "all_reduce the divisor over {axis} before dividing"),
    "mean over shard": (
        "a mean over one rank's shard is a partial average: only an AVG all-reduce completes it",
        "sum over the shard and divide by the global count, or all_reduce(AVG) over {axis}"),
    "normalization over shard": (
        "the op normalises along a dim that is split over the ranks, using only the local part",
        "all_gather over {axis} first, or compute the statistics with collectives"),
    "global shape mismatch": (
        "a replicated full-size operand is combined with one rank's slice of a sharded one",
        "slice the replicated operand by rank (sc.rank_slice) or all_gather the sharded one over {axis}"),
    "mixed shards": (
        "the operands are split along different dims, so their local pieces do not line up",
        "redistribute one operand over {axis} so both are sharded on the same dim"),
    "shard counted as replica": (
        "the value is cut over the axis, but the code takes it for a replica and counts only "
        "one rank's piece (e.g. in a norm over parameters)",
        "count every rank's piece: mark the value as sharded over {axis}"),
    "double count": (
        "a SUM all-reduce of a replicated value adds n copies of the same value",
        "drop this all_reduce, or reduce the partial value instead"),
    "gather of replicated": (
        "all_gather of a replicated value concatenates n copies of it",
        "drop the all_gather over {axis}, or gather the sharded value"),
    "scatter of replicated": (
        "reduce_scatter of a replicated value sums n copies of it",
        "slice by rank instead (sc.rank_slice), or reduce-scatter the partial value"),
    "split of varying": (
        "the tensor already differs per rank, so taking this rank's chunk of it keeps only a "
        "fraction of each rank's data",
        "split the replicated value, or check which group's rank indexes the split"),
    "broadcast of partial": (
        "a broadcast sends one rank's partial sum to every rank: the other ranks' parts are lost",
        "all_reduce over {axis} instead of broadcasting"),
    "mean of partial": (
        "an AVG reduction of partial sums divides their sum by the axis size",
        "reduce with SUM over {axis}"),
    "unknown axis": (
        "the collective runs on a group whose ranks match no axis of the mesh",
        "use the process group of the axis the data is laid out on"),
    "assertion": ("sc.assert_type found another type", "fix the program or the assertion"),
    "contract": ("an argument does not have the type the function's contract requires",
                 "convert the argument before the call"),
}


class SpmdTypeError(RuntimeError):
    """An op would compute a wrong global value. The first line starts with ``checker:``."""

    def __init__(self, message: str, rule: str, location: str, op: str) -> None:
        super().__init__(message)
        self.rule, self.location, self.op = rule, location, op


@dataclass(frozen=True)
class ViolationRecord:
    """One violation: the rule, the user's file:line, the op and the full message.

    ``axis`` and ``coordinate`` (this rank's index on it) name where the rule broke;
    ``occurrence`` numbers a by-rank cut of a varying tensor (see :func:`checker.confirmed_across_ranks`).
    """

    rule: str
    location: str
    op: str
    message: str
    axis: str | None = None
    coordinate: int | None = None
    occurrence: int | None = None
    backward: str = ""  # the C++ autograd node the op ran for (e.g. "CatBackward0"), "" elsewhere
    partial: tuple[int, ...] = ()  # the op's tensor operands (by index) partial on ``axis``

    @property
    def first_line(self) -> str:
        return self.message.splitlines()[0]

    def as_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "location": self.location, "op": self.op, "line": self.first_line,
                "axis": self.axis, "coordinate": self.coordinate, "occurrence": self.occurrence,
                "backward": self.backward, "partial": list(self.partial)}
