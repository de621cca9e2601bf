"""The MoE top-k router with its load-balancing losses, optionally with a padding mask.

Tokens are split over context parallelism by sequence chunk, then over tensor parallelism by
sequence parallelism (MoE requires it with TP>1; the catalogue refuses TP>1 without it). The scenario runs the router forward,
back-propagates a fixed upstream gradient through the routing probabilities (which also
triggers the auxiliary-loss gradients), sums the gradients over CP (the net effect of DDP's
average over DP x CP of a loss that the schedules scale by the CP size) and all-reduces those of
sequence-parallel parameters over TP as ``finalize_model_grads`` does, and returns
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

from shardcheck.megatron.checks.typecheck import harness_typed
from shardcheck.megatron.cpu.parallel import megatron_parallel, world_group
from shardcheck.megatron.scenarios.gpt import GPTSetup, transformer_config
from shardcheck.megatron.scenarios.output_loss import _sequence_gather, _sequence_shard
from shardcheck.megatron.scenarios.reference import (
    gather_global,
    load_global_weights,
    seeded_global,
)
from shardcheck.patching import patched
from shardcheck.typecheck.types import R, S


def _token_shard(tensor: torch.Tensor, layout: Any, pg: Any) -> torch.Tensor:
    """This rank's tokens: its CP chunk of the sequence, then its sequence-parallel share
    (over the scenario's groups ``pg``). The chunk is typed (where cp and dp have one size,
    the checker cannot tell which group's rank chose it): S(0) on cp and on any axis over the
    cp ranks (ep at cp2-ep2), R on the others, whose ranks hold the same tokens."""
    cp_ranks = set(dist.get_process_group_ranks(pg.cp))
    chunk = harness_typed(tensor.chunk(layout.cp, dim=0)[pg.cp.rank()], **{
        axis: S(0) if set(dist.get_process_group_ranks(group)) == cp_ranks else R
        for axis in ("cp", "dp", "ep", "pp") if (group := getattr(pg, axis, None)) is not None})
    return _sequence_shard(chunk, layout.sp, pg.tp)


def _token_gather(tensor: torch.Tensor, layout: Any, pg: Any) -> torch.Tensor:
    """The global tokens back from every rank's share (the inverse of :func:`_token_shard`)."""
    chunk = _sequence_gather(tensor, layout.sp, pg.tp)
    parts = [torch.empty_like(chunk) for _ in range(layout.cp)]
    dist.all_gather(parts, chunk.contiguous(), group=pg.cp)
    return torch.cat(parts, dim=0)


@dataclass(frozen=True)
class RouterSetup:
    """Sizes and options of the router scenario; ``config`` overrides TransformerConfig."""

    hidden: int = 16
    seq: int = field(default=8, metadata={"fuzz": (4, 8, 16)})
    batch: int = field(default=2, metadata={"fuzz": (1, 2)})
    experts: int = 4
    topk: int = 2
    padding: bool = False
    seed: int = 0
    # TopKRouter's own constructor arguments, swept as ``TopKRouter.<arg>``
    model_args: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


def _padding_mask(setup: RouterSetup) -> torch.Tensor | None:
    """[seq, batch], True marks padding: the tail of each sequence, unevenly over the ranks."""
    if not setup.padding:
        return None
    mask = torch.zeros(setup.seq, setup.batch, dtype=torch.bool)
    mask[setup.seq * 5 // 8:, 0] = True
    mask[setup.seq - 1:, 1] = True
    return mask


def _finalize_grads(module: torch.nn.Module, pg: Any) -> None:
    for param in module.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, group=pg.cp)
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=pg.tp)


@contextmanager
def _recording_token_counts(counts: list[torch.Tensor]) -> Iterator[None]:
    """Record the ``local_num_tokens`` Megatron's router computes, passing every value through."""
    from megatron.core.transformer.moe import router as router_module

    original = router_module.get_tokens_per_expert_and_token_count

    def recorded(*args, **kwargs):
        result = original(*args, **kwargs)
        counts.append(torch.as_tensor(result[1], dtype=torch.float32).clone())
        return result

    with patched(router_module, "get_tokens_per_expert_and_token_count", recorded):
        yield


def router_step(ctx: Any, setup: RouterSetup) -> dict[str, torch.Tensor]:
    """Forward and backward of Megatron's TopKRouter under ``ctx``; global values by name."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    with megatron_parallel(ctx) as explicit:
        pg = explicit or ProcessGroupCollection.use_mpu_process_groups()
        options = dict(num_moe_experts=setup.experts, moe_router_topk=setup.topk,
                       moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="aux_loss",
                       add_bias_linear=False)
        if setup.model_args.get("is_mtp_layer"):  # Megatron builds an MTP layer's router in a model with MTP layers
            options["mtp_num_layers"] = 1
        options.update(setup.config)
        config = transformer_config(ctx.layout, GPTSetup(hidden=setup.hidden, heads=4, layers=1),
                                    **options)
        router = TopKRouter(config, pg, **setup.model_args)
        router.set_layer_number(1)  # as MoELayer numbers its router
        router.train()
        load_global_weights(router, seed=setup.seed)
        layout = ctx.layout
        hidden = _token_shard(seeded_global("tokens", (setup.seq, setup.batch, setup.hidden),
                                            setup.seed).float() * 20, layout, pg).requires_grad_(True)
        mask = _padding_mask(setup)
        counts: list[torch.Tensor] = []
        with _recording_token_counts(counts):
            probs, routing_map = router(
                hidden, padding_mask=None if mask is None else _token_shard(mask, layout, pg))
        # each rank's count of its own valid tokens: summed over TP x CP, the global count
        local_counts = torch.stack(counts) if counts else torch.zeros(0)
        dist.all_reduce(local_counts, group=pg.tp_cp)
        upstream = _token_shard(seeded_global("upstream", (setup.seq * setup.batch, setup.experts),
                                              setup.seed).float().view(setup.seq, -1), layout, pg)
        (probs * upstream.reshape(probs.shape)).sum().backward()
        _finalize_grads(router, pg)
        grads, _ = gather_global(router, lambda p: p.grad, world_group(ctx))
        seq_major = (-1, setup.batch, setup.experts)
        return {
            "probs": _token_gather(probs.detach().reshape(seq_major), layout, pg),
            "routing_map": _token_gather(routing_map.reshape(seq_major).float(), layout, pg),
            "hidden_grad": _token_gather(hidden.grad, layout, pg),
            "local_num_tokens_summed": local_counts,
            **{f"grad/{k}": v for k, v in grads.items()},
        }
