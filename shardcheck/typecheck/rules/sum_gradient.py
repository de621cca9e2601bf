"""The gradient of a sum over a sharded dim, laid out like the summed tensor.

``x.sum(0)`` of a sequence shard S(0) is a partial sum (P), whose gradient is replicated (R).
Autograd's ``SumBackward`` expands that gradient to ``x``'s local shape: one value along the
rank's own rows, which are the rank's rows of the global gradient (one value along every row),
so S(0) as ``x`` is, not R. Typed R it would be a full global value of the rank's local length:
a later sum over those rows would be complete (no all-reduce needed) and an all-reduce of it a
double count, the other way round from the numbers.

The backward node keeps no tensor of ``x``: the forward sum notes ``x``'s placements on the
autograd node that made ``x`` (``metadata``, by output number), which the sum's backward node
reaches as its next function; a leaf's is read from ``AccumulateGrad``'s variable.
"""

from __future__ import annotations

import torch

from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.rules.common import Refinement, RuleContext, is_sum, norm_dim, replicated
from shardcheck.typecheck.types import P, RankChunk, Routed, Shard

aten = torch.ops.aten
_KEY = "shardcheck.summed"  # the producing node's metadata: {output number: (mesh key, placements)}
_SUM_NODES = frozenset({"SumBackward0", "SumBackward1"})


def _laid_out(p, summed) -> bool:
    """Whether the gradient of a sum that made ``summed`` of a tensor placed ``p`` is laid out
    as ``p``: a shard of a summed dim (routed rows may hold padding the sum left out; a rank's
    chunk is a guess)."""
    return is_sum(summed) and isinstance(p, Shard) and not isinstance(p, Routed | RankChunk)


def _sum(base, ctx: RuleContext, args, kwargs, out):
    """sum: the base rule; where autograd will take its gradient through a summed shard, note
    the summed tensor's placements on the node that made it. A sum of a shard is never an
    outcome of its signature alone (whether its operand requires grad is not in it)."""
    pl = base(ctx, args, kwargs, out)
    x, xl = args[0], ctx.types(args[0])
    if pl is None or xl is None:
        return pl
    laid_out = tuple(p if _laid_out(p, q) else None for p, q in zip(xl, pl, strict=True))
    if any(p is not None for p in laid_out):
        tensor_state.wrote_elsewhere()
        if x.grad_fn is not None and torch.is_grad_enabled():
            x.grad_fn.metadata.setdefault(_KEY, {})[x.output_nr] = (ctx.key, laid_out)
    return pl


def _summed_layout(ctx: RuleContext) -> tuple | None:
    """Per axis, the summed tensor's shard (None where it has none), or None outside a sum's
    backward."""
    node = torch._C._current_autograd_node()
    if node is None or node.name() not in _SUM_NODES or not node.next_functions:
        return None
    made, number = node.next_functions[0]
    if made is None:
        return None
    leaf = getattr(made, "variable", None)
    if isinstance(leaf, torch.Tensor):
        pl = ctx.types(leaf)
        return None if pl is None else tuple(p if _laid_out(p, P) else None for p in pl)
    key, laid_out = made.metadata.get(_KEY, {}).get(number, (None, None))
    return laid_out if key is ctx.key else None


def _expand(base, ctx: RuleContext, args, kwargs, out):
    """expand: in a sum's backward, a replicated gradient is laid out like the summed tensor
    along the shards the sum took."""
    pl = base(ctx, args, kwargs, out)
    if pl is None or not any(replicated(p) for p in pl):
        return pl
    laid_out = _summed_layout(ctx)
    if laid_out is None:
        return pl
    x, lead = args[0], out.dim() - args[0].dim()
    expanded = {d for d in range(out.dim()) if d < lead or x.shape[d - lead] == 1}
    return tuple(s if s is not None and replicated(p) and norm_dim(s.dim, out.dim()) in expanded else p
                 for p, s in zip(pl, laid_out, strict=True))


RULES_BY_OP: dict = {}
REFINEMENTS = (
    Refinement((aten.sum,), _sum),
    Refinement((aten.expand,), _expand, "expand"),
)
