"""The all-to-all of rows grouped by destination, and back: where :class:`types.Routed` comes from.

Rows a rank read by its grouped index (``token_rows``) are marked with their groups' counts
(the ``rows_of`` field of its :mod:`tensor_state`). At an uneven all-to-all (split sizes given) the ranks of the group exchange
what they send: each rank's counts per group and its input splits. Where every rank sends
rank k exactly its rows of groups [k*L, (k+1)*L) (its counts summed by block of L), every
rank's received rows are :class:`Routed` on the group's axes, their table the counts each
rank sent of its local groups. An all-to-all of routed rows holding every received part in
order, sending each rank back what it sent, restores the rows' type before the route. Rows
routed from a value other than each rank's own rows (V) or a row shard are V: a replicated
value routed so would reach the experts once per rank.
"""

from __future__ import annotations

import torch

from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.rules.common import RuleContext, gathered_objects, norm_dim
from shardcheck.typecheck.types import Pl, Route, Routed, SectionShard, Shard, V


def mark_rows(out: torch.Tensor, mark) -> None:
    """Remember that ``out``'s rows are grouped by ``mark`` (a ``token_rows.Grouped``)."""
    tensor_state.write(out, "rows_of", (mark.key, mark.axes, mark.counts, mark.rows))


def routed_types(ctx: RuleContext, output: torch.Tensor, inp: torch.Tensor, pl: Pl | None, group, ranks: tuple[int, ...],
                 axes: list[int], output_splits, input_splits) -> Pl | None:
    """The types of an uneven all-to-all's ``output`` when it routes rows (see the module
    docstring), else None. Every rank of the group exchanges here (split sizes are given on
    every rank of an SPMD program alike)."""
    if not output_splits or not input_splits or inp.dim() == 0:
        return None
    grouping = tensor_state.read(inp, "rows_of")
    mine = (grouping[2], tuple(input_splits)) if grouping is not None and grouping[0] is ctx.key else None
    with ctx.paused():
        offers = gathered_objects(group, mine)
    if pl is None or offers is None:
        return None
    if mine is not None:
        route = _route(offers, ranks.index(ctx.mesh.rank), tuple(output_splits), grouping)
        return None if route is None else _on(pl, axes, lambda p: _dispatched(p, route, inp.dim()))
    return _combined(pl, axes, tuple(output_splits), tuple(input_splits))


def _route(offers: list, k: int, output_splits: tuple[int, ...], grouping) -> Route | None:
    """This rank's (index ``k``) view of the routing, if every rank sends each rank its block."""
    n = len(offers)
    if any(o is None or len(o[0]) % n or len(o[0]) != len(offers[0][0]) for o in offers):
        return None
    local = len(offers[0][0]) // n
    blocks = [tuple(sum(counts[d * local:(d + 1) * local]) for d in range(n)) for counts, _ in offers]
    if any(block != splits for block, (_, splits) in zip(blocks, offers, strict=True)):
        return None
    table = tuple(tuple(counts[k * local:(k + 1) * local]) for counts, _ in offers)
    if tuple(sum(row) for row in table) != output_splits:
        return None
    return Route(table, offers[k][1], grouping)


def _dispatched(p, route: Route, ndim: int):
    if p is V or (type(p) in (Shard, SectionShard) and norm_dim(p.dim, ndim) == 0):
        return Routed(0, route, route.received, p)
    return V


def _combined(pl: Pl, axes: list[int], output_splits: tuple, input_splits: tuple) -> Pl | None:
    """Every received part sent back to where it came from: the rows' type before the route."""
    def back(p):
        ok = (type(p) is Routed and p.dim == 0 and p.parts == p.route.received and output_splits == p.route.sent
              and input_splits == tuple(sum(row) for row in p.route.table))
        return p.source if ok else V
    if not any(type(pl[a]) is Routed for a in axes):
        return None
    return _on(pl, axes, back)


def _on(pl: Pl, axes: list[int], step) -> Pl:
    return tuple(step(p) if a in axes and p is not None else p for a, p in enumerate(pl))

