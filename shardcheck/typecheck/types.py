"""The SPMD type lattice (R, P, V, I, S and their refinements: P(avg), P(even), block, section
and routed shards, gathered blocks) and the mesh of named process-group axes they refer to."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache

import torch.distributed as dist


class Placement:
    """How one tensor is laid out across the ranks of one axis."""

    __slots__ = ()
    symbol = "?"

    def __repr__(self) -> str:
        return self.symbol


class Singleton(Placement):
    """A placement with one instance, compared by identity: it unpickles as itself (ranks
    exchange types), found by its module-level name."""

    __slots__ = ()
    pickle_name = "?"

    def __reduce__(self) -> str:
        return self.pickle_name


class _Replicate(Singleton):
    """R: every rank holds the same full value."""

    __slots__ = ()
    symbol = pickle_name = "R"


class _Partial(Singleton):
    """P: the true value is the sum over the axis of the ranks' values."""

    __slots__ = ()
    symbol = pickle_name = "P"


class _Varying(Singleton):
    """V: ranks hold different values with no sum or concatenation meaning."""

    __slots__ = ()
    symbol = pickle_name = "V"


class _Invariant(Singleton):
    """I: the same value on every rank, used identically."""

    __slots__ = ()
    symbol = pickle_name = "I"


R: Placement = _Replicate()
P: Placement = _Partial()
V: Placement = _Varying()
I: Placement = _Invariant()  # noqa: E741


class Shard(Placement):
    """S(d): the global value is the concatenation of the ranks' values along dim d.

    Where two axes shard one dim, the slower one's pieces hold the faster one's (Megatron's
    cp outside tp), unless the faster one is ``outside``: its pieces hold the other's (a
    column block of tp cut into cp pieces by an all-to-all over cp)."""

    __slots__ = ("dim", "outside")

    def __init__(self, dim: int, outside: bool = False) -> None:
        self.dim = dim
        self.outside = outside

    def __repr__(self) -> str:
        return f"S({self.dim}, outside)" if self.outside else f"S({self.dim})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shard) and other.dim == self.dim and other.outside == self.outside

    def __hash__(self) -> int:
        return hash(("S", self.dim, self.outside))


@cache
def S(dim: int, outside: bool = False) -> Shard:  # noqa: N802 - the type's own name
    """The interned S(dim) placement (``outside``: see :class:`Shard`)."""
    return Shard(dim, outside)


# --- refinements of P and S ----------------------------------------------------------------

class _PartialAverage(Singleton):
    """A mean over one rank's shard: only an AVG all-reduce turns it into R."""

    __slots__ = ()
    symbol, pickle_name = "P(avg)", "PAVG"


class _EvenPartial(Singleton):
    """A partial sum of which every rank holds the same share (a sum over equal shards of a
    constant, e.g. the token count of an all-ones mask): the global value is n times the
    local one. It is a P; :func:`elementwise` and the positively homogeneous ops know more."""

    __slots__ = ()
    symbol, pickle_name = "P(even)", "PEVEN"


class Gathered(Placement):
    """All-gathered along dim 0 from shards on ``dim``: rank blocks stacked on dim 0."""

    __slots__ = ("dim",)

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def __repr__(self) -> str:
        return f"G({self.dim})"


class RankChunk(Shard):
    """S(d) from the rank-slice heuristic on a split: this rank's chunk of an R tensor.

    It acts as S(d), except where the pieces of the split are put back together (cat,
    list collectives): there it is what it really holds on every rank, R.
    """

    __slots__ = ()


class GatheredPiece(RankChunk):
    """Element j of a list all_gather of S(d): rank j's piece, the same on every rank. Put
    back together along d (cat) the pieces are R; along another dim they line up with nothing
    of the global value (V)."""

    __slots__ = ()


class BlockShard(Shard):
    """S(d) of a merged dim whose sharded factor is inner: dim d holds ``outer`` blocks, and
    in each block the ranks' pieces are concatenated in rank order. Megatron's attention
    builds it: [s, b, np, hn] -> [s, b*np, hn] with np sharded is S(1) with b blocks; the
    reverse view makes it S on np again."""

    __slots__ = ("outer",)

    def __init__(self, dim: int, outer: int, outside: bool = False) -> None:
        super().__init__(dim, outside)
        self.outer = outer

    def __repr__(self) -> str:
        return f"S({self.dim}, blocks={self.outer}{', outside' if self.outside else ''})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BlockShard) and other.dim == self.dim
                and other.outer == self.outer and other.outside == self.outside)

    def __hash__(self) -> int:
        return hash(("S", self.dim, self.outer, self.outside))


class SectionShard(Shard):
    """S(d) of a fused dim: the global dim concatenates sections (e.g. query, key, value), each
    sharded over the axis, and every rank holds its piece of each section, in order;
    ``sections`` are the local lengths. Megatron's fused column-parallel weights are laid out
    so (their ``sharded_state_dict`` splits them per section); cutting such a dim at section
    boundaries gives S(d) pieces."""

    __slots__ = ("sections",)

    def __init__(self, dim: int, sections: tuple[int, ...], outside: bool = False) -> None:
        super().__init__(dim, outside)
        self.sections = tuple(sections)

    def __repr__(self) -> str:
        return f"S({self.dim}, sections={list(self.sections)}{', outside' if self.outside else ''})"

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and other.dim == self.dim
                and other.sections == self.sections and other.outside == self.outside)

    def __hash__(self) -> int:
        return hash(("S", self.dim, self.sections, self.outside))

    def piece(self, start: int, length: int) -> Shard | None:
        """The shard of the local range [start, start+length) if it is whole sections."""
        bounds = [0]
        for size in self.sections:
            bounds.append(bounds[-1] + size)
        if start not in bounds or start + length not in bounds:
            return None
        inner = self.sections[bounds.index(start):bounds.index(start + length)]
        return S(self.dim, self.outside) if len(inner) == 1 else SectionShard(self.dim, inner, self.outside)


class InterleavedShard(SectionShard):
    """A fused dim (sections of local lengths ``chunks`` times ``count``) with each section cut
    into ``count`` chunks and the chunks grouped by chunk: chunk 0 of every section, then
    chunk 1, ... (GDN's head permutation before its one all-to-all over cp). As a
    SectionShard, its sections are those chunks in that order; sent to the ``count`` ranks
    of a group by an all-to-all, rank k gets chunk k of every section."""

    __slots__ = ("count",)

    def __init__(self, dim: int, chunks: tuple[int, ...], count: int, outside: bool = False) -> None:
        super().__init__(dim, tuple(chunks) * count, outside)
        self.count = count

    @property
    def chunks(self) -> tuple[int, ...]:
        return self.sections[:len(self.sections) // self.count]

    def __repr__(self) -> str:
        return f"S({self.dim}, sections={list(self.chunks)} x {self.count}{', outside' if self.outside else ''})"

    def __hash__(self) -> int:
        return hash(("S", self.dim, self.sections, self.count, self.outside))


def interleaved(dim: int, chunks: tuple[int, ...], count: int, outside: bool = False) -> Shard:
    """The shard of sections ``chunks`` x ``count`` grouped by chunk; one section is a plain shard."""
    if len(chunks) == 1:
        return S(dim, outside)
    return InterleavedShard(dim, chunks, count, outside)


PAVG: Placement = _PartialAverage()
PEVEN: Placement = _EvenPartial()

Pl = tuple  # per-axis placements, None where unknown


def parse_placement(text: str) -> Placement:
    """Parse 'R', 'P', 'V', 'I' or 'S(d)'."""
    text = text.strip()
    simple = {"R": R, "P": P, "V": V, "I": I}
    if text in simple:
        return simple[text]
    if text.startswith("S(") and text.endswith(")"):
        return S(int(text[2:-1]))
    raise ValueError(f"unknown placement {text!r}: expected R, P, V, I or S(d)")


def parse_alternatives(text: str) -> tuple[Placement, ...]:
    """Parse 'A|B|...': placements any one of which is accepted (e.g. 'S(0)|V')."""
    return tuple(parse_placement(part) for part in text.split("|"))


@dataclass(frozen=True)
class Axis:
    """One mesh axis: a name and the ordered global ranks of this rank's group on it."""

    name: str
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)


class Mesh:
    """Named process groups ('tp', 'dp', ...) seen from this rank.

    An axis is identified by its ordered tuple of global ranks, so two groups over the same
    ranks are the same axis. A group may span several axes at once (Megatron's dp x cp);
    :meth:`axes_of` matches it to those axes by rank sets.
    """

    def __init__(self, rank: int | None = None, **groups: dist.ProcessGroup | Iterable[int]) -> None:
        self.axes: dict[str, Axis] = {}
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        for name, group in groups.items():
            if isinstance(group, dist.ProcessGroup):
                ranks = tuple(dist.get_process_group_ranks(group))
            else:
                ranks, group = tuple(group), None
            self.axes[name] = Axis(name, ranks)
            self.groups[name] = group
        self.rank = self._own_rank() if rank is None else rank
        self._by_ranks: dict[tuple[int, ...], tuple[str, ...] | None] = {}

    def _own_rank(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        common = set.intersection(*(set(a.ranks) for a in self.axes.values())) if self.axes else set()
        if len(common) != 1:
            raise ValueError("pass rank=: it cannot be derived from the axes")
        return common.pop()

    @classmethod
    def from_device_mesh(cls, device_mesh) -> Mesh:
        """Build a mesh from a ``torch.distributed.device_mesh.DeviceMesh`` with named dims."""
        names = device_mesh.mesh_dim_names
        if not names:
            raise ValueError("the DeviceMesh needs mesh_dim_names to name its axes")
        return cls(**{name: device_mesh.get_group(name) for name in names})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.axes)

    def __repr__(self) -> str:
        inner = ", ".join(f"{a.name}={list(a.ranks)}" for a in self.axes.values())
        return f"Mesh({inner})"

    def axes_of(self, ranks: Iterable[int]) -> tuple[str, ...] | None:
        """The axes a group over ``ranks`` acts on, or None when it matches no axis combination.

        A single-rank group acts on no axis and returns ``()``.
        """
        key = tuple(ranks)
        if key not in self._by_ranks:
            self._by_ranks[key] = self._match(frozenset(key))
        return self._by_ranks[key]

    def _match(self, ranks: frozenset[int]) -> tuple[str, ...] | None:
        if len(ranks) == 1:
            return ()
        candidates = [a for a in self.axes.values() if a.size > 1 and set(a.ranks) <= ranks]
        for count in range(1, len(candidates) + 1):
            for combo in itertools.combinations(candidates, count):
                if _span(self.rank, combo) == ranks:
                    return self._with_aliases(combo)
        return None

    def _with_aliases(self, combo: tuple[Axis, ...]) -> tuple[str, ...]:
        """The combination's axes and every other axis over the same ranks as one of them: a
        group over those ranks acts on each (Megatron's ep and dp at dp2-ep2)."""
        same = {frozenset(a.ranks) for a in combo}
        return tuple(a.name for a in self.axes.values()
                     if a in combo or (a.size > 1 and frozenset(a.ranks) in same))

    def nested(self, dim: int, *axes: str) -> dict[str, Shard]:
        """The placements of a tensor whose dim ``dim`` is cut over ``axes`` in turn, the first
        outermost (a sequence cut over cp, then each piece over tp for sequence parallelism):
        S(dim) on each, ``outside`` on an axis faster in rank order than one whose pieces it
        holds (see :class:`Shard`), so the same cut reads the same under any rank order."""
        self.placements(dict.fromkeys(axes, R))  # unknown axes: ValueError
        strides = {a: abs(r[1] - r[0]) for a in axes if len(r := self.axes[a].ranks) > 1}
        return {a: S(dim, a in strides and any(strides[a] < strides[b] for b in axes[i + 1:] if b in strides))
                for i, a in enumerate(axes)}

    def placements(self, spec: Mapping[str, Placement]) -> dict[str, Placement]:
        """Validate a {axis name: placement} mapping against this mesh."""
        unknown = set(spec) - set(self.axes)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; the mesh has {list(self.axes)}")
        return dict(spec)


def _span(origin: int, axes: tuple[Axis, ...]) -> frozenset[int]:
    """Ranks reachable from ``origin`` along the given axes, assuming a translation-invariant grid."""
    reach = {origin}
    for axis in axes:
        reach = {r + (a - origin) for r in reach for a in axis.ranks}
    return frozenset(reach)


# --- rows routed between ranks by group --------------------------------------------------
#
# Rows routed between the ranks of an axis by group (MoE's token dispatch), as a placement.
#
# Each rank lists its own rows group after group (``token_rows``' grouped index: the rows it
# routes to each expert). An uneven all-to-all that sends rank k the rows of its block of ``L``
# consecutive groups (its local experts) gives rank k every rank's rows of those groups, each
# row on one rank only: the global rows, cut over the ranks by destination. ``Routed`` says so,
# with the parts (source rank, local group) in local order; their row counts are the route's
# table, which the ranks exchange at the all-to-all (see :mod:`routing`).
#
# Row-wise ops keep the placement (a matmul by the rank's own group's weight, S on the axis by
# the convention of expert weights, too); parts of one route cut and joined are parts again. A
# contraction over the rows of one local group's every part (from every rank that sent rows)
# is that group's complete value, the rank's own: S(0), as its experts are declared. Over any
# other set of routed rows it is the rank's share of a sum over all rows (P). An all-to-all
# sending every part back to the rank it came from restores the rows' type before the route
# (``source``).


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
    order, whose rows came from ranks whose own rows were ``source`` (V or a row shard), and
    then ``pad`` rows of no part (a quantized expert's rows padded to a multiple of its
    block: rows of zeros where ``zero_pad``)."""

    __slots__ = ("route", "parts", "source", "pad", "zero_pad")

    def __init__(self, dim: int, route: Route, parts: tuple[tuple[int, int], ...], source: Placement,
                 pad: int = 0, zero_pad: bool = True) -> None:
        super().__init__(dim)
        self.route, self.parts, self.source = route, tuple(parts), source
        self.pad, self.zero_pad = pad, zero_pad or not pad

    def __repr__(self) -> str:
        padding = f" + {self.pad} {'zero' if self.zero_pad else 'pad'} rows" if self.pad else ""
        return f"S({self.dim}, routed {list(self.parts)}{padding})"

    def __eq__(self, other: object) -> bool:
        return (type(other) is Routed and other.dim == self.dim and other.parts == self.parts
                and other.route == self.route and other.source == self.source
                and other.pad == self.pad and other.zero_pad == self.zero_pad)

    def __hash__(self) -> int:
        return hash(("routed", self.dim, self.parts, self.pad))

    def lines_up(self, other: Routed) -> bool:
        """Whether the local rows of both are the same rows (their sources and the values of
        their padding rows may differ)."""
        return other.parts == self.parts and other.route == self.route and other.pad == self.pad

    def at(self, dim: int, source: Placement | None = None, zero_pad: bool | None = None) -> Routed:
        return Routed(dim, self.route, self.parts, self.source if source is None else source,
                      self.pad, self.zero_pad if zero_pad is None else zero_pad)

    def padded(self, rows: int, zero: bool) -> Routed:
        """These rows followed by ``rows`` more rows of no part (zeros where ``zero``)."""
        return Routed(self.dim, self.route, self.parts, self.source, self.pad + rows,
                      zero and self.zero_pad)

    def piece(self, start: int, length: int) -> Routed | None:
        """The parts of the local rows [start, start+length), if it starts and ends at part
        bounds (the padding rows, if it takes them, all of them at its end)."""
        bounds = [0]
        for part in self.parts:
            bounds.append(bounds[-1] + self.route.count(part))
        end = start + length
        pad = self.pad if self.pad and end == bounds[-1] + self.pad else 0
        if start not in bounds or end - pad not in bounds or (pad and start == bounds[-1]):
            return None
        first, last = bounds.index(start), bounds.index(end - pad)
        return Routed(self.dim, self.route, self.parts[first:last], self.source, pad, self.zero_pad)

    def complete(self) -> bool:
        """Whether the parts are every sent part of one local group, each once."""
        groups = {g for _, g in self.parts}
        if len(groups) != 1 or len(set(self.parts)) != len(self.parts):
            return False
        (group,) = groups
        return set(self.parts) == {part for part in self.route.received if part[1] == group}


def joined(pieces: list[Routed], dim: int) -> Routed | None:
    """Routed pieces of one route joined along their rows, in order (padding rows only at the
    end), else None."""
    first, last = pieces[0], pieces[-1]
    if any(p.route != first.route or p.dim != first.dim for p in pieces) or any(p.pad for p in pieces[:-1]):
        return None
    sources = {p.source for p in pieces}
    source = sources.pop() if len(sources) == 1 else V
    return Routed(dim, first.route, tuple(part for p in pieces for part in p.parts), source,
                  last.pad, last.zero_pad)
