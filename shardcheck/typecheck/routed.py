"""Rows routed between the ranks of an axis by group (MoE's token dispatch), as a placement.

Each rank lists its own rows group after group (``token_rows``' grouped index: the rows it
routes to each expert). An uneven all-to-all that sends rank k the rows of its block of ``L``
consecutive groups (its local experts) gives rank k every rank's rows of those groups, each
row on one rank only: the global rows, cut over the ranks by destination. ``Routed`` says so,
with the parts (source rank, local group) in local order; their row counts are the route's
table, which the ranks exchange at the all-to-all (see :mod:`routing`).

Row-wise ops keep the placement (a matmul by the rank's own group's weight, S on the axis by
the convention of expert weights, too); parts of one route cut and joined are parts again. A
contraction over the rows of one local group's every part (from every rank that sent rows)
is that group's complete value, the rank's own: S(0), as its experts are declared. Over any
other set of routed rows it is the rank's share of a sum over all rows (P). An all-to-all
sending every part back to the rank it came from restores the rows' type before the route
(``source``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardcheck.typecheck.types import Placement, Shard, V


@dataclass(frozen=True)
class Route:
    """One routing seen from this rank: ``table[j][l]``, the rows source rank ``j`` (index on
    the group) sent of this rank's local group ``l``; ``sent``, this rank's rows per destination;
    ``grouping``, the mark of this rank's grouped index (``token_rows.Grouped``)."""

    table: tuple[tuple[int, ...], ...]
    sent: tuple[int, ...]
    grouping: object

    @property
    def received(self) -> tuple[tuple[int, int], ...]:
        """The parts in the order the all-to-all delivers them, empty ones left out."""
        return tuple((j, g) for j, row in enumerate(self.table) for g, count in enumerate(row) if count)

    def count(self, part: tuple[int, int]) -> int:
        return self.table[part[0]][part[1]]


class Routed(Shard):
    """S(dim) of rows routed by ``route``: this rank holds ``parts`` (source, local group) in
    order, whose rows came from ranks whose own rows were ``source`` (V or a row shard)."""

    __slots__ = ("route", "parts", "source")

    def __init__(self, dim: int, route: Route, parts: tuple[tuple[int, int], ...], source: Placement) -> None:
        super().__init__(dim)
        self.route, self.parts, self.source = route, tuple(parts), source

    def __repr__(self) -> str:
        return f"S({self.dim}, routed {list(self.parts)})"

    def __eq__(self, other: object) -> bool:
        return (type(other) is Routed and other.dim == self.dim and other.parts == self.parts
                and other.route == self.route and other.source == self.source)

    def __hash__(self) -> int:
        return hash(("routed", self.dim, self.parts))

    def lines_up(self, other: Routed) -> bool:
        """Whether the local rows of both are the same rows (their sources may differ)."""
        return other.parts == self.parts and other.route == self.route

    def at(self, dim: int, source: Placement | None = None) -> Routed:
        return Routed(dim, self.route, self.parts, self.source if source is None else source)

    def piece(self, start: int, length: int) -> Routed | None:
        """The parts of the local rows [start, start+length), if it starts and ends at part bounds."""
        bounds = [0]
        for part in self.parts:
            bounds.append(bounds[-1] + self.route.count(part))
        if start not in bounds or start + length not in bounds:
            return None
        first, last = bounds.index(start), bounds.index(start + length)
        return Routed(self.dim, self.route, self.parts[first:last], self.source)

    def complete(self) -> bool:
        """Whether the parts are every sent part of one local group, each once."""
        groups = {g for _, g in self.parts}
        if len(groups) != 1 or len(set(self.parts)) != len(self.parts):
            return False
        (group,) = groups
        return set(self.parts) == {part for part in self.route.received if part[1] == group}


def joined(pieces: list[Routed], dim: int) -> Routed | None:
    """Routed pieces of one route joined along their rows, in order, else None."""
    first = pieces[0]
    if any(p.route != first.route or p.dim != first.dim for p in pieces):
        return None
    sources = {p.source for p in pieces}
    source = sources.pop() if len(sources) == 1 else V
    return Routed(dim, first.route, tuple(part for p in pieces for part in p.parts), source)
