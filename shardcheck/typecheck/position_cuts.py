"""A shard cut by position along its sharded dim, worked on piece by piece, joined again.

``x.chunk(k, dim=0)`` of a sequence shard S(0) cuts each rank's own rows: piece i holds rows of
every rank, so it is no layout of the one-rank run's chunk i (V). Megatron's
``mlp_chunks_for_training`` runs the MLP on each piece as on a shorter sequence (all-gathered,
reduce-scattered: each piece's result is S(0) of its own rows) and joins the results with
``torch.cat``. Joined in order, the pieces' results are the source's rows again, in the
source's layout, not sections of a fused dim. This module remembers such cuts and tells a
join of them apart from a cat of independent shards:

- forward: each joined tensor must reach the cut's autograd node through piece j only, for
  the j-th tensor (found by walking its autograd graph; no graph, no join);
- backward: the cut's own backward (``SplitBackward0``) joins the pieces' gradients; a hook on
  that node, set when the forward join was seen, marks it.

What is assumed: the work on each piece keeps its rows apart (a token-wise MLP does); work
that mixes a piece's rows is not told apart.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch

_KEPT = 32  # cuts (and marked backward nodes) remembered at once
_WALK = 512  # autograd nodes visited per joined tensor


class PositionCuts:
    """The recent position cuts of shards, and the backward nodes that join them again."""

    def __init__(self) -> None:
        self._cuts: list[tuple[list[weakref.ref], tuple]] = []
        self._backward: OrderedDict[int, tuple] = OrderedDict()

    def note(self, pieces: list[torch.Tensor], source: tuple) -> None:
        """``pieces`` were cut by position from a tensor of placements ``source``."""
        self._cuts = self._cuts[-(_KEPT - 1):] + [([weakref.ref(p) for p in pieces], source)]

    def forward_join(self, tensors: list[torch.Tensor]) -> tuple | None:
        """The source placements when ``tensors`` are made, in order, from the pieces of one
        cut (each from its own piece), else None. A join seen marks the cut's backward."""
        cuts = self._live_cuts()
        if not cuts:
            return None
        reached = [_pieces_reached(t, cuts) for t in tensors]
        nodes = {node for edges in reached for node, _ in edges}
        if len(nodes) != 1 or None in nodes:
            return None
        node = nodes.pop()
        count, source = cuts[node]
        if count != len(tensors) or any(edges != {(node, j)} for j, edges in enumerate(reached)):
            return None
        self._mark_backward(node, source)
        return source

    def backward_join(self) -> tuple | None:
        """The source placements when the running autograd node is a joined cut's backward."""
        node = torch._C._current_autograd_node()
        return None if node is None else self._backward.get(id(node))

    def _live_cuts(self) -> dict[Any, tuple[int, tuple]]:
        live = {}
        for refs, source in self._cuts:
            pieces = [r() for r in refs]
            node = pieces[0].grad_fn if pieces[0] is not None else None
            if node is not None and all(p is not None and p.grad_fn is node for p in pieces):
                live[node] = (len(pieces), source)
        return live

    def _mark_backward(self, node: Any, source: tuple) -> None:
        key = id(node)
        if key in self._backward:
            return
        self._backward[key] = source
        while len(self._backward) > _KEPT:
            self._backward.popitem(last=False)

        def done(_grad_inputs: Any, _grad_outputs: Any) -> None:
            self._backward.pop(key, None)

        node.register_hook(done)


def _pieces_reached(t: torch.Tensor, cuts: dict[Any, tuple[int, tuple]]) -> set[tuple[Any, int]]:
    """(cut node, piece index) edges that ``t``'s autograd graph reaches; a graph too large to
    walk reaches a sentinel that joins nothing."""
    root = t.grad_fn
    if root is None:
        return set()
    if root in cuts:  # t is a piece itself
        return {(root, t.output_nr)}
    reached, seen, stack = set(), {root}, [root]
    while stack:
        if len(seen) > _WALK:
            return {(None, -1)}
        for node, nr in stack.pop().next_functions:
            if node is None:
                continue
            if node in cuts:
                reached.add((node, nr))
            elif node not in seen:
                seen.add(node)
                stack.append(node)
    return reached
