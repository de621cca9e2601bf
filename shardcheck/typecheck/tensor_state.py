"""All the checker keeps on a tensor: one record (attribute ``_sc``), read and written through
this module only (the type store sets fields on the record :func:`record` gives it, and reads a
record's type through :data:`ATTR` itself: the hottest read, one Python call less).

The fields:

- ``type``: (mesh key, placements, :class:`~shardcheck.typecheck.rules.registry.Known`), the
  tensor's type in the region of that mesh; ``untyped``: the mesh key of a region that computed
  or wrote this one-element tensor without a type (it is no unseen scalar there).
- ``root``, ``views``, ``spans``, ``overlaps``: a view's root; a root's weak references to its
  views, and the storage spans they cover; the views a write overlaps (see ``checker``).
- ``origin``: where an unknown value began (coverage by site); ``landing``: an async
  collective lands on it when waited on.
- ``broadcast``: the dims it is a broadcast along (see :mod:`broadcast`).
- ``cut``, ``stacked``, ``gathered``: pieces cut from a typed tensor, chunks stacked, rows
  all-gathered (see :mod:`rules.common`); ``exchanged``, ``exchanged_piece``: an all-to-all's
  output and its pieces (see :mod:`exchange`); ``grouped``, ``rows_of``: an index of grouped
  rows and rows read by it (see :mod:`rules.token_rows`, :mod:`rules.routing`); ``norm``: the
  gradient norm term it is (see :mod:`rules.norm_tracking`); ``viewed``: a view's other reading
  of its shards (see :mod:`rules.shape`).
"""

from __future__ import annotations

from typing import Any

ATTR = _ATTR = "_sc"
# Record writes so far (one count for all fields): the checker compares it around a rule's run
# to tell a rule that wrote a field (a side effect, see op_memo) from one that only typed its result.
WRITES = [0]
# The fields a rule remembered by op_memo may find on its operands: their types, and the view
# bookkeeping of the type store and the landing mark of an async collective, which no rule reads.
_PLAIN = frozenset({"type", "root", "views", "spans", "overlaps", "landing"})


class TensorState:
    """The record on one tensor; every field starts as None.

    The fields are class attributes, so a new record sets none of them: one is made for most
    op results (a thousand a Megatron step), and setting 17 slots cost 3 µs each. A field
    never written reads its class default; a name that is no field fails to read."""

    type = untyped = root = views = spans = overlaps = origin = landing = None
    broadcast = cut = stacked = gathered = exchanged = exchanged_piece = None
    grouped = rows_of = norm = viewed = None


def read(t: Any, field: str) -> Any:
    """``t``'s ``field``, or None where ``t`` has none (any object may be asked)."""
    state = getattr(t, _ATTR, None)
    return None if state is None else getattr(state, field)


def write(t: Any, field: str, value: Any) -> None:
    """Set ``t``'s ``field`` to ``value`` (None forgets it)."""
    WRITES[0] += 1
    state = getattr(t, _ATTR, None)
    if state is None:
        if value is None:
            return
        state = TensorState()
        setattr(t, _ATTR, state)
    setattr(state, field, value)


def wrote_elsewhere() -> None:
    """Count a rule's write outside any record (an autograd node's metadata) as a record write:
    its outcome then depends on more than its operands' signature (see op_memo)."""
    WRITES[0] += 1


def record(t: Any) -> TensorState:
    """``t``'s record, made where it has none, for the type store to set fields on directly
    (one call for several fields: the dispatch's hot path); counted as a write."""
    WRITES[0] += 1
    state = getattr(t, _ATTR, None)
    if state is None:
        state = TensorState()
        setattr(t, _ATTR, state)
    return state


def any_set(values: Any, field: str) -> bool:
    """Whether any of ``values`` has ``field`` set (one call for an op's arguments)."""
    for t in values:
        state = getattr(t, _ATTR, None)
        if state is not None and getattr(state, field) is not None:
            return True
    return False


def type_of(t: Any) -> tuple | None:
    """``t``'s (mesh key, placements, known value), or None (the checker's hot path)."""
    state = getattr(t, _ATTR, None)
    return None if state is None else state.type


def plain_type(t: Any) -> tuple | None | bool:
    """``t``'s type (as :func:`type_of`) when its record holds no field but its type and view
    bookkeeping (or it has none), else False."""
    state = getattr(t, _ATTR, None)
    if state is None:
        return None
    if not state.__dict__.keys() <= _PLAIN:
        return False
    return state.type
