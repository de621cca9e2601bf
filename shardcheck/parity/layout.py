"""Parallel layouts (tp, cp, dp, ep, etp, pp, sp) and the rank grid they put the process groups on.

Rank order
----------
``order`` lists the dimensions from the fastest-varying to the slowest, like Megatron's
``"tp-cp-ep-dp-pp"``: with ``tp2-dp2`` ranks 0 and 1 form a tensor-parallel group and ranks 0
and 2 a data-parallel group. A rank's coordinate on dimension ``k`` is
``(rank // stride_k) % size_k``, where ``stride_k`` is the product of the sizes listed before it.

Expert parallelism does not add ranks: ``ep`` must divide ``dp * cp`` and its groups are blocks
of ``ep`` consecutive members of each (rank-sorted) ``dp_cp`` group, wherever ``ep`` appears in
``order``.

Expert tensor parallelism (``etp``, Megatron's ``expert_tensor_parallel_size``) is the tp size
of the experts; it defaults to ``tp``. Given another size, the experts get their own grid, as
Megatron builds it: etp x ep x edp x pp over the same ranks, in ``order`` (cp left out), so
``etp * ep`` must divide ``tp * cp * dp`` (``ep`` need not divide ``dp * cp`` then). Its groups
are ``etp``, ``ep`` and ``edp`` (expert data parallel); with the default etp, ``etp`` is ``tp``
and ``edp`` the members of each ``dp_cp`` group that hold the same experts.

Groups
------
``tp``, ``cp``, ``dp``, ``pp``: the ranks that differ only on that dimension, ordered by
coordinate. Combined groups are ordered by rank: ``dp_cp`` (dp x cp, Megatron's data-parallel
group with context parallelism), ``mp`` (tp x pp, "model parallel"), ``ep`` and ``world``.
``explicit_groups`` replaces the groups of one or more base dimensions, e.g. tensor-parallel
groups ``[[0, 2], [1, 3]]`` with data-parallel groups ``[[0, 1], [2, 3]]``; the base groups must
still form a grid (every rank has a unique coordinate tuple, and a group's members share
all their other coordinates).

``tp2-dp2@dp-tp`` names a layout whose explicit groups are those of another rank order (here
dp fastest, then tp; dimensions not named follow in the default order): what a model given
its own process groups sees while Megatron's global groups keep the default order.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from math import prod

BASE_DIMS = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_PART = re.compile(r"^(tp|cp|dp|ep|etp|pp)(\d+)$")


class LayoutError(ValueError):
    """A layout that cannot be built; its message is one line meant for the user."""


@dataclass(frozen=True)
class Layout:
    """Sizes of each parallel dimension, sequence parallelism, rank order and explicit groups."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    pp: int = 1
    sp: bool = False
    order: str = DEFAULT_ORDER
    explicit_groups: Mapping[str, Sequence[Sequence[int]]] | None = field(default=None, hash=False)
    etp: int | None = None  # the experts' tp size; None: tp (a given size equal to tp becomes None)

    def __post_init__(self) -> None:
        for dim in (*BASE_DIMS, "ep"):
            if not isinstance(getattr(self, dim), int) or getattr(self, dim) < 1:
                raise LayoutError(f"layout {dim} must be a positive integer, got {getattr(self, dim)!r}")
        if self.sp and self.tp == 1:
            raise LayoutError("sequence parallelism (sp) needs tp > 1")
        _validate_etp(self)
        dims = self.order.split("-")
        if sorted(d for d in dims if d != "ep") != sorted(BASE_DIMS) or len(set(dims)) != len(dims):
            raise LayoutError(f"order {self.order!r} must list tp, cp, dp, pp once each (and optionally ep)")
        _validate_explicit(self)

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parse ``'tp2-dp2-sp'``-style strings: parts tp<N>, cp<N>, dp<N>, ep<N>, etp<N>, pp<N>, sp;
        a suffix ``@ORDER`` (e.g. ``'tp2-dp2@dp-tp'``) gives explicit groups, see :meth:`regrouped`."""
        base, at, order = text.partition("@")
        layout = cls._parse_sizes(base)
        return layout.regrouped(order) if at else layout

    @classmethod
    def _parse_sizes(cls, text: str) -> Layout:
        sizes: dict[str, int] = {}
        sp = False
        parts = text.strip().lower().split("-") if text.strip() else []
        if not parts:
            raise LayoutError(f"malformed layout {text!r}: it is empty; expected e.g. 'tp2-dp2-sp'")
        for part in parts:
            match = _PART.match(part)
            if part == "sp" and not sp:
                sp = True
            elif match and match.group(1) not in sizes and int(match.group(2)) >= 1:
                sizes[match.group(1)] = int(match.group(2))
            else:
                raise LayoutError(
                    f"malformed layout {text!r}: bad or repeated part {part!r}; "
                    "expected parts tp<N>, cp<N>, dp<N>, ep<N>, etp<N>, pp<N>, sp, e.g. 'tp2-dp2-sp'")
        return cls(sp=sp, **sizes)

    @classmethod
    def coerce(cls, layout: Layout | str) -> Layout:
        """A layout from a Layout or its string form."""
        return layout if isinstance(layout, Layout) else cls.parse(layout)

    def regrouped(self, order: str) -> Layout:
        """This layout with explicit groups: those it would have under rank order ``order``
        (its dimensions of size > 1 from the fastest; the others follow in this layout's order)."""
        named = order.strip().lower().split("-") if order.strip() else []
        if not named or any(d not in BASE_DIMS for d in named) or len(set(named)) != len(named):
            raise LayoutError(f"malformed group order {order!r}: expected distinct dims from "
                              f"{', '.join(BASE_DIMS)}, e.g. 'dp-tp'")
        rest = [d for d in self.order.split("-") if d not in named and d != "ep"]
        other = replace(self, order="-".join(named + rest), explicit_groups=None)
        groups = {d: [list(g) for g in other.partition(d)] for d in BASE_DIMS if getattr(self, d) > 1}
        if all(other.partition(d) == self.partition(d) for d in groups):
            raise LayoutError(f"order {order!r} gives {self} its default groups; "
                              "name an order whose groups differ")
        return replace(self, explicit_groups=groups)

    @property
    def global_layout(self) -> Layout:
        """The layout without explicit groups: the groups of its rank order."""
        return replace(self, explicit_groups=None)

    def __str__(self) -> str:
        parts = [f"{d}{getattr(self, d)}" for d in ("tp", "cp", "dp", "ep", "etp", "pp")
                 if d == "etp" and self.etp is not None or d != "etp" and getattr(self, d) > 1]
        parts += ["sp"] if self.sp else []
        base = "-".join(parts) or "tp1"
        if not self.explicit_groups:
            return base
        if self._explicit_order:
            return f"{base}@{self._explicit_order}"
        return f"{base} (explicit {', '.join(sorted(self.explicit_groups))})"

    @cached_property
    def _explicit_order(self) -> str | None:
        """The shortest ``@ORDER`` whose groups are this layout's explicit groups, if any."""
        dims = [d for d in BASE_DIMS if getattr(self, d) > 1]
        for named in itertools.permutations(dims):
            try:
                candidate = self.global_layout.regrouped("-".join(named))
            except LayoutError:
                continue
            if all(candidate.partition(d) == self.partition(d) for d in BASE_DIMS):
                return "-".join(named)
        return None

    def spanning(self, dims: Sequence[str]) -> list[tuple[int, ...]]:
        """The groups of ranks whose coordinates differ only on ``dims`` (each sorted by rank)."""
        return _combine(self._grid.coords, keep=tuple(d for d in BASE_DIMS if d not in dims))

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size: ``etp``, else ``tp``."""
        return self.tp if self.etp is None else self.etp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def size(self, dim: str) -> int:
        """The size of a base dimension or a combined group."""
        combined = {"dp_cp": self.dp * self.cp, "mp": self.tp * self.pp, "world": self.world_size}
        return combined.get(dim) or getattr(self, dim)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each base dimension (its position in its group there)."""
        return {dim: self._grid.coords[rank][dim] for dim in BASE_DIMS}

    def partition(self, name: str) -> list[tuple[int, ...]]:
        """All groups named ``name`` (a base dim, 'dp_cp', 'mp', 'ep', 'etp', 'edp' or 'world'),
        each ordered."""
        return self._grid.partitions[name]

    def group_ranks(self, name: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group named ``name``."""
        return next(g for g in self.partition(name) if rank in g)

    @cached_property
    def _grid(self) -> _Grid:
        return _Grid.build(self)


GROUP_NAMES = (*BASE_DIMS, "ep", "dp_cp", "mp", "world")


@dataclass
class _Grid:
    """Every group partition of a layout, and each rank's base coordinates."""

    coords: list[dict[str, int]]
    partitions: dict[str, list[tuple[int, ...]]]

    @classmethod
    def build(cls, layout: Layout) -> _Grid:
        base = _base_partitions(layout)
        coords = _coords_from(base, layout.world_size)
        partitions = dict(base)
        partitions["dp_cp"] = _combine(coords, keep=("tp", "pp"))
        partitions["mp"] = _combine(coords, keep=("cp", "dp"))
        partitions["world"] = [tuple(range(layout.world_size))]
        partitions.update(_expert_partitions(layout, partitions))
        return cls(coords, partitions)


EXPERT_GROUPS = ("etp", "ep", "edp")


def _expert_partitions(layout: Layout, dense: Mapping[str, list[tuple[int, ...]]]) -> dict[str, list[tuple[int, ...]]]:
    """The expert grid's groups: with the default etp, ep blocks of each ``dp_cp`` group (etp
    is tp); else Megatron's own expert grid, etp x ep x edp x pp in the layout's order."""
    ep = layout.ep
    if layout.etp is None:
        return {"etp": list(dense["tp"]),
                "ep": [g[i:i + ep] for g in dense["dp_cp"] for i in range(0, len(g), ep)],
                "edp": [g[i::ep] for g in dense["dp_cp"] for i in range(ep)]}
    sizes = {"etp": layout.etp, "ep": ep, "edp": layout.world_size // (layout.pp * layout.etp * ep), "pp": layout.pp}
    names = {"tp": "etp", "dp": "edp", "ep": "ep", "pp": "pp"}
    dims = [names[d] for d in layout.order.split("-") if d in names]
    dims += ["ep"] if "ep" not in dims else []
    strides = {d: prod(sizes[o] for o in dims[:dims.index(d)]) for d in dims}
    return {d: _strided_groups(layout.world_size, strides[d], sizes[d]) for d in EXPERT_GROUPS}


def _strided_groups(world: int, stride: int, size: int) -> list[tuple[int, ...]]:
    starts = [r for r in range(world) if (r // stride) % size == 0]
    return [tuple(s + i * stride for i in range(size)) for s in starts]


def _default_partition(layout: Layout, dim: str) -> list[tuple[int, ...]]:
    dims = [d for d in layout.order.split("-") if d != "ep"]
    stride = prod(getattr(layout, d) for d in dims[:dims.index(dim)])
    return _strided_groups(layout.world_size, stride, getattr(layout, dim))


def _validate_etp(layout: Layout) -> None:
    """ep (and etp) against the world, as Megatron's ``initialize_model_parallel`` checks them."""
    if layout.etp is None or layout.etp == layout.tp:
        object.__setattr__(layout, "etp", None)
        if (layout.dp * layout.cp) % layout.ep:
            raise LayoutError(f"ep={layout.ep} must divide dp*cp={layout.dp * layout.cp}")
        return
    dense = layout.tp * layout.cp * layout.dp
    if not isinstance(layout.etp, int) or layout.etp < 1 or dense % (layout.etp * layout.ep):
        raise LayoutError(f"etp={layout.etp!r} times ep={layout.ep} must divide tp*cp*dp={dense}")
    if layout.explicit_groups:
        raise LayoutError("explicit groups (@ORDER) with an etp other than tp are not supported")


def _base_partitions(layout: Layout) -> dict[str, list[tuple[int, ...]]]:
    explicit = layout.explicit_groups or {}
    return {dim: [tuple(g) for g in explicit[dim]] if dim in explicit else _default_partition(layout, dim)
            for dim in BASE_DIMS}


def _coords_from(base: Mapping[str, list[tuple[int, ...]]], world: int) -> list[dict[str, int]]:
    coords: list[dict[str, int]] = [{} for _ in range(world)]
    for dim, groups in base.items():
        for group in groups:
            for position, rank in enumerate(group):
                coords[rank][dim] = position
    return coords


def _combine(coords: list[dict[str, int]], keep: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Groups of ranks that agree on the ``keep`` coordinates, each sorted by rank."""
    buckets: dict[tuple[int, ...], list[int]] = {}
    for rank, c in enumerate(coords):
        buckets.setdefault(tuple(c[d] for d in keep), []).append(rank)
    return [tuple(sorted(b)) for b in buckets.values()]


def _validate_explicit(layout: Layout) -> None:
    explicit = layout.explicit_groups or {}
    unknown = set(explicit) - set(BASE_DIMS)
    if unknown:
        raise LayoutError(f"explicit_groups names {sorted(unknown)}; allowed: {list(BASE_DIMS)}")
    world = layout.world_size
    for dim, groups in explicit.items():
        flat = sorted(r for g in groups for r in g)
        if flat != list(range(world)) or any(len(g) != getattr(layout, dim) for g in groups):
            raise LayoutError(f"explicit {dim} groups {groups} must split ranks 0..{world - 1} "
                              f"into groups of {getattr(layout, dim)}")
    if explicit:
        base = _base_partitions(layout)
        coords = _coords_from(base, world)
        if len({tuple(c[d] for d in BASE_DIMS) for c in coords}) != world or any(
                len({tuple(coords[r][o] for o in BASE_DIMS if o != dim) for r in g}) != 1
                for dim, groups in base.items() for g in groups):
            raise LayoutError(f"explicit groups {dict(explicit)} do not form a grid with the other "
                              "dimensions; give the other dimensions' groups explicitly too")
