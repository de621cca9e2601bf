"""The MoE top-k router with its load-balancing losses, optionally with a padding mask.

Tokens are split over tensor parallelism by sequence parallelism (MoE requires it with TP>1).
The scenario runs the router forward, back-propagates a fixed upstream gradient through the
routing probabilities (which also triggers the auxiliary-loss gradients), all-reduces the
gradients of sequence-parallel parameters over TP as ``finalize_model_grads`` does, and returns
global values: routing probabilities and map, the router's gradients, and the sum over TP x CP
of the ``local_num_tokens`` each rank's router computed (recorded as it is returned, unchanged),
which must equal the one-rank count. The router gets the explicit ``pg_collection`` under
explicit groups (else ``parallel_state``'s), and the harness shards over its groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.megatron.parallel import megatron_parallel, world_group
from shardcheck.megatron.reference import gather_global, load_global_weights, seeded_global
from shardcheck.megatron.scenarios.gpt import GPTSetup, transformer_config
from shardcheck.megatron.scenarios.output_loss import _sequence_gather, _sequence_shard


@dataclass(frozen=True)
class RouterSetup:
    """Sizes and options of the router scenario; ``config`` overrides TransformerConfig."""

    hidden: int = 16
    seq: int = 8
    batch: int = 2
    experts: int = 4
    topk: int = 2
    padding: bool = False
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)


def _padding_mask(setup: RouterSetup) -> torch.Tensor | None:
    """[seq, batch], True marks padding: the tail of each sequence, unevenly over the ranks."""
    if not setup.padding:
        return None
    mask = torch.zeros(setup.seq, setup.batch, dtype=torch.bool)
    mask[setup.seq * 5 // 8:, 0] = True
    mask[setup.seq - 1:, 1] = True
    return mask


def _finalize_sequence_parallel_grads(module: torch.nn.Module, tp: dist.ProcessGroup) -> None:
    for param in module.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=tp)


@contextmanager
def _recording_token_counts(counts: list[torch.Tensor]) -> Iterator[None]:
    """Record the ``local_num_tokens`` Megatron's router computes, passing every value through."""
    from megatron.core.transformer.moe import router as router_module

    original = router_module.get_tokens_per_expert_and_token_count

    def recorded(*args, **kwargs):
        result = original(*args, **kwargs)
        counts.append(torch.as_tensor(result[1], dtype=torch.float32).clone())
        return result

    router_module.get_tokens_per_expert_and_token_count = recorded
    try:
        yield
    finally:
        router_module.get_tokens_per_expert_and_token_count = original


def _check_layout(layout: Any) -> None:
    """Refuse layouts whose tokens this scenario does not lay out as Megatron would."""
    from shardcheck.megatron.parallel import LayoutUnsupported

    if layout.tp > 1 and not layout.sp:
        raise LayoutUnsupported("MoE with tp > 1 needs sequence parallelism (MoELayer refuses it)")
    if layout.cp > 1:
        raise LayoutUnsupported("the router scenario does not cut tokens for context parallelism")


def router_step(ctx: Any, setup: RouterSetup) -> dict[str, torch.Tensor]:
    """Forward and backward of Megatron's TopKRouter under ``ctx``; global values by name."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    _check_layout(ctx.layout)
    with megatron_parallel(ctx) as explicit:
        pg = explicit or ProcessGroupCollection.use_mpu_process_groups()
        options = dict(num_moe_experts=setup.experts, moe_router_topk=setup.topk,
                       moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="aux_loss",
                       add_bias_linear=False)
        options.update(setup.config)
        config = transformer_config(ctx.layout, GPTSetup(hidden=setup.hidden, heads=4, layers=1),
                                    **options)
        router = TopKRouter(config, pg)
        router.train()
        load_global_weights(router, seed=setup.seed)
        sp = ctx.layout.sp
        hidden = _sequence_shard(seeded_global("tokens", (setup.seq, setup.batch, setup.hidden),
                                               setup.seed).float() * 20, sp, pg.tp).requires_grad_(True)
        mask = _padding_mask(setup)
        counts: list[torch.Tensor] = []
        with _recording_token_counts(counts):
            probs, routing_map = router(
                hidden, padding_mask=None if mask is None else _sequence_shard(mask, sp, pg.tp))
        # each rank's count of its own valid tokens: summed over TP x CP, the global count
        local_counts = torch.stack(counts) if counts else torch.zeros(0)
        dist.all_reduce(local_counts, group=pg.tp_cp)
        upstream = _sequence_shard(seeded_global("upstream", (setup.seq * setup.batch, setup.experts),
                                                 setup.seed).float().view(setup.seq, -1), sp, pg.tp)
        (probs * upstream.reshape(probs.shape)).sum().backward()
        _finalize_sequence_parallel_grads(router, pg.tp)
        grads, _ = gather_global(router, lambda p: p.grad, world_group(ctx))
        seq_major = (-1, setup.batch, setup.experts)
        return {
            "probs": _sequence_gather(probs.detach().reshape(seq_major), sp, pg.tp),
            "routing_map": _sequence_gather(routing_map.reshape(seq_major).float(), sp, pg.tp),
            "hidden_grad": _sequence_gather(hidden.grad, sp, pg.tp),
            "local_num_tokens_summed": local_counts,
            **{f"grad/{k}": v for k, v in grads.items()},
        }
