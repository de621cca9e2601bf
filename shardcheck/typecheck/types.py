"""SPMD placement types and the mesh of named process-group axes they refer to."""

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
