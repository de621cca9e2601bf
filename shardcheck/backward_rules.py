"""Rules for loss kernels and their backward kernels that the base table lacks.

Registered through ``register_rule``, so the base table stays as it is. Each backward kernel
is linear in its incoming gradient and non-linear in the saved forward values.
"""

from __future__ import annotations

import torch

from shardcheck.checker import register_rule
from shardcheck.rules import MUL, NL, RULES, _arg, _reduce_axis, elementwise

aten = torch.ops.aten
_REDUCTION_KIND = {1: "mean", 2: "sum"}  # at::Reduction: 0 none, 1 mean, 2 sum


def _pointwise_loss(ctx, args, kwargs, out):
    """mse_loss / l1_loss / smooth_l1_loss / huber_loss(self, target, reduction, ...)."""
    pl = elementwise(ctx, [(args[0], NL), (args[1], NL)])
    kind = _REDUCTION_KIND.get(_arg(args, kwargs, 2, "reduction", 1))
    if pl is None or kind is None:
        return pl
    every_dim = set(range(args[0].dim()))
    return tuple(_reduce_axis(kind, p, a, every_dim, False) for a, p in enumerate(pl))


def _pointwise_loss_backward(ctx, args, kwargs, out):
    """*_loss_backward(grad, self, target, reduction, ...): linear in grad."""
    return elementwise(ctx, [(args[0], MUL), (args[1], NL), (args[2], NL)])


for _loss in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"):
    register_rule(getattr(aten, _loss), _pointwise_loss)
    backward = getattr(aten, _loss + "_backward", None)
    if backward is not None:
        register_rule(backward, _pointwise_loss_backward)


# scaled_dot_product_attention's CPU math path normalises with _safe_softmax(x, dim).
register_rule(aten._safe_softmax, RULES["_softmax"])
