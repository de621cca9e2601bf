"""The type store: each tensor's type and what is known of its value (its
:mod:`tensor_state` record), and the views that share its storage, so that a write into one
retypes every tracked tensor it overlaps."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.rules.registry import (
    CONST_OR_ZERO,
    NOTHING,
    WITH_ACC,
    WITH_ONE_RANK,
    ZERO,
    Known,
)
from shardcheck.typecheck.rules.shape import same_elements, view_shard
from shardcheck.typecheck.tensor_state import ATTR
from shardcheck.typecheck.types import Shard, V
from shardcheck.typecheck.violations import Violation


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.storage_offset()
    if t.is_contiguous():
        return start, start + t.numel()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    return start, start + (extent if t.numel() else 0)


# Counts the events that may have moved a tensor over its storage (new offset, shape or strides)
# unseen by the spans cached in _view_spans: a region entered, an in-place view op or an out=
# op dispatched, ``.data =``.
LAYOUT_EPOCH = [0]


def _view_spans(root: torch.Tensor, views: list) -> list[tuple[int, int, Any]]:
    """(start, end, weakref) of the storage each live view of ``root`` spans, cached on
    ``root`` while no layout can have changed and no view was dropped (new ones are added)."""
    cached = tensor_state.read(root, "spans")
    if cached is None or cached[0] != LAYOUT_EPOCH[0] or cached[1] > len(views):
        cached = (LAYOUT_EPOCH[0], 0, [])
    elif cached[1] == len(views):
        return cached[2]
    spans = cached[2]
    for ref in views[cached[1]:]:
        view = ref()
        if view is not None:
            spans.append((*_storage_range(view), ref))
    tensor_state.write(root, "spans", (cached[0], len(views), spans))
    return spans


def _overlapping(t: torch.Tensor, span: tuple[int, int], spans: list) -> list:
    """The weakrefs of the views in ``spans`` (see _view_spans) that overlap ``span``, ``t``'s,
    cached on ``t`` while that spans list only grew (a gradient buffer's views are many, and
    the same few of them are written again and again)."""
    cached = tensor_state.read(t, "overlaps")
    if cached is not None and cached[0] is spans and cached[1] == span:
        if cached[2] == len(spans):
            return cached[3]
        found, seen = cached[3], cached[2]
    else:
        found, seen = [], 0
    lo, hi = span
    found = found + [ref for a_lo, a_hi, ref in spans[seen:] if a_lo < hi and lo < a_hi]
    tensor_state.write(t, "overlaps", (spans, span, len(spans), found))
    return found


def _same_region(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.storage_offset() == b.storage_offset() and a.shape == b.shape
            and a.stride() == b.stride())


class TypeStore:
    """Reads and writes the types of tensors in the region of mesh ``key`` (the checker is one)."""

    key: tuple

    def types(self, t: Any) -> tuple | None:
        state = getattr(t, ATTR, None)  # tensor_state.type_of, inline: rules ask at every op
        st = None if state is None else state.type
        if st is None or st[0] is not self.key:
            return None
        return st[1]

    def zero(self, t: Any) -> bool:
        st = tensor_state.type_of(t)
        return st is not None and st[0] is self.key and st[2] == ZERO

    def const(self, t: Any) -> bool:
        st = tensor_state.type_of(t)
        return st is not None and st[0] is self.key and st[2] in CONST_OR_ZERO

    def accumulated(self, t: Any) -> bool:
        """Whether ``t`` is zeros that one value was added into (see ACC)."""
        return self._flags(t) in WITH_ACC

    def added_on_some_ranks(self, t: Any) -> bool:
        """Whether ``t`` is zeros a value was added into in a branch on the rank."""
        return self._flags(t) in WITH_ONE_RANK

    def _flags(self, t: Any) -> Known:
        state = getattr(t, ATTR, None)  # as in types
        st = None if state is None else state.type
        return st[2] if st is not None and st[0] is self.key else NOTHING

    def unseen_scalar(self, t: torch.Tensor) -> bool:
        """Whether untyped ``t`` is a scalar made before the region (one element: a loss scale,
        a coefficient of the model's), read as a constant of unknown value; one this region
        computed or wrote without a type is not: it may differ per rank."""
        return t.numel() == 1 and tensor_state.read(t, "untyped") is not self.key

    def set_type(self, t: torch.Tensor, pl: tuple | None, flags: Known = Known.NOTHING) -> None:
        """Type ``t``; with no type, a one-element ``t`` is no longer an unseen scalar."""
        if pl is not None and pl.count(None) != len(pl):
            tensor_state.write(t, "type", (self.key, pl, flags))
            return
        if tensor_state.type_of(t) is not None:
            tensor_state.write(t, "type", None)
        if t.numel() == 1:
            tensor_state.write(t, "untyped", self.key)

    def update_inplace(self, t: torch.Tensor, pl: tuple | None,
                       transform: Callable[[tuple], tuple] | None = None,
                       flags: Known = Known.NOTHING) -> None:
        """Retype ``t`` in place, and every tracked tensor overlapping its storage."""
        old = self.types(t)
        self.set_type(t, pl, flags)
        root = tensor_state.read(t, "root")
        if root is None and t._base is not None:  # a view made outside the region still shares
            root = tensor_state.read(t._base, "root")  # its base's views
            if root is None:
                root = t._base
        elif root is None:
            root = t
        views = tensor_state.read(root, "views")
        if not views and root is t:
            return
        span = _storage_range(t)
        a_lo, a_hi = _storage_range(root)
        if root is not t and a_lo < span[1] and span[0] < a_hi:
            self._retype_alias(root, t, old, pl, transform, flags)
        for ref in _overlapping(t, span, _view_spans(root, views)) if views else ():
            alias = ref()
            if alias is not None and alias is not t:
                self._retype_alias(alias, t, old, pl, transform, flags)

    def _retype_alias(self, alias, t, old, pl, transform, flags: Known) -> None:
        """After ``t`` was written, retype ``alias``, which overlaps it (left as it is where
        that changes nothing)."""
        st = tensor_state.type_of(alias)
        if st is None or st[0] is not self.key:
            return
        same = _same_region(alias, t)
        new, new_flags = _alias_type(alias, st, t, old, pl, transform, same), flags if same else NOTHING
        if new != st[1] or new_flags != st[2]:
            self.set_type(alias, new, new_flags)

    def type_result(self, t: torch.Tensor, pl: tuple | None, flags: Known, base: torch.Tensor | None) -> None:
        """:meth:`set_type` of an op's result, then, for a view of ``base`` with a type,
        :meth:`register_view`: the dispatch's common case, in one call."""
        if pl is None or pl.count(None) == len(pl):
            self.set_type(t, pl, flags)
            if base is not None and pl is not None:
                self.register_view(t, base)
            return
        state = tensor_state.record(t)
        state.type = (self.key, pl, flags)
        if base is not None:
            _add_view(t, state, base)

    def register_view(self, view: torch.Tensor, base: torch.Tensor) -> None:
        """Remember that ``view`` aliases ``base``'s storage (on their common root)."""
        _add_view(view, tensor_state.record(view), base)


def _add_view(view: torch.Tensor, view_state: tensor_state.TensorState, base: torch.Tensor) -> None:
    """register_view, given ``view``'s record (``base``'s record read once: most bases are roots)."""
    state = tensor_state.record(base)
    root = state.root
    if root is None:
        root = base
    else:
        state = tensor_state.record(root)
    view_state.root = root
    views = state.views
    if views is None:
        state.views = [weakref.ref(view)]
        return
    views.append(weakref.ref(view))
    if len(views) % 64 == 0:
        views[:] = [w for w in views if w() is not None]
        state.spans = None


def _alias_type(alias, alias_st: tuple, t, old, pl, transform, same: bool) -> tuple | None:
    """``alias``'s type (``alias_st``: its record's, in this region) after ``t`` was written
    ``pl`` over part of it (``same``: over the same elements)."""
    alias_pl = alias_st[1]
    if transform is not None:
        try:
            return transform(alias_pl)
        except Violation:
            return None
    if pl is None:
        return None
    if same:
        return pl
    alias_zero = alias_st[2] == ZERO
    merged = []
    for a, (mine, new) in enumerate(zip(alias_pl, pl, strict=True)):
        if new is V and mine is not V:  # values of each rank's own written into it
            merged.append(V)
        elif mine == new or (old is not None and old[a] == new):
            merged.append(mine)
        elif alias_zero and not isinstance(new, Shard):
            merged.append(new)
        elif alias_zero and same_elements(alias, t):  # zeros overwritten whole
            merged.append(view_shard(t.shape, alias.shape, new))
        else:
            merged.append(None)
    return tuple(merged)
