"""One training step of a whole Megatron model through its schedules, shared by the model scenarios.

``DistributedDataParallel``, ``get_forward_backward_func()`` over this data-parallel rank's
microbatches and ``finalize_model_grads``; then the global results: the reported loss, every
parameter's gradient (from Megatron's shard metadata) and recorded module outputs gathered
over sequence and data parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.megatron.checks.typecheck import MESH_AXES, harness_typed
from shardcheck.megatron.cpu.parallel import (
    LayoutUnsupported,
    explicit_kwargs,
    scenario_groups,
    world_group,
)
from shardcheck.megatron.scenarios.gpt import reported_loss, schedule_groups
from shardcheck.megatron.scenarios.output_loss import _sequence_gather
from shardcheck.megatron.scenarios.reference import gather_global, gradient_of
from shardcheck.typecheck.types import R, V


def data_parallel_share(batches: list[dict[str, torch.Tensor]], pg: Any = None) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's contiguous share of the global microbatches (built alike on
    every rank): its values vary over dp and are replicated (R) over the other axes."""
    dp_group = scenario_groups(pg).dp
    dp, dp_rank = dp_group.size(), dp_group.rank()
    if len(batches) % dp:
        raise LayoutUnsupported(f"{len(batches)} microbatches do not split over dp={dp}")
    share = len(batches) // dp
    mine = batches[dp_rank * share:(dp_rank + 1) * share]
    for batch in mine:
        for value in batch.values():
            harness_typed(value, **{**dict.fromkeys(MESH_AXES, R), "dp": V})
    return mine


def schedule_step(config, model: torch.nn.Module, forward_step: Callable[..., Any],
               batches: list[dict[str, torch.Tensor]], seq_length: int,
               micro_batch: int, pg: Any = None) -> list[dict[str, torch.Tensor]]:
    """Forward and backward of ``batches`` under DDP and Megatron's schedule (with the explicit
    groups ``pg`` where the layout has them); the loss reports."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model, **explicit_kwargs(pg))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    ddp.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=None, model=[ddp],
        num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=micro_batch,
        forward_only=False, **schedule_groups(pg, config))


@contextmanager
def recorded(module: torch.nn.Module, pick: Callable[..., torch.Tensor],
             before: bool = False) -> Iterator[list[torch.Tensor]]:
    """Record ``pick(args, kwargs)`` of every call of ``module`` (``before``) or
    ``pick(output)`` after it, detached."""
    seen: list[torch.Tensor] = []
    if before:
        handle = module.register_forward_pre_hook(
            lambda _m, args, kwargs: seen.append(pick(args, kwargs).detach().clone()),
            with_kwargs=True)
    else:
        handle = module.register_forward_hook(lambda _m, _a, out: seen.append(pick(out).detach().clone()))
    try:
        yield seen
    finally:
        handle.remove()


def gathered_microbatches(seen: list[torch.Tensor], sp: bool, pg: Any = None) -> torch.Tensor:
    """Every microbatch's [s, b, ...] tensor, gathered over tp (under sp) and dp: [mb, s, b, ...]."""
    used = scenario_groups(pg)
    mine = torch.stack([_sequence_gather(value, sp, used.tp) for value in seen])
    group = used.dp
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine.contiguous(), group=group)
    return torch.cat(parts)


def global_results(ctx: Any, model: torch.nn.Module, config,
                   reports: list[dict[str, torch.Tensor]], pg: Any = None) -> dict[str, torch.Tensor]:
    """The reported loss, every gradient and the largest disagreement between gradient replicas."""
    grads, spread = gather_global(model, gradient_of, world_group(ctx))
    return {"loss": reported_loss([r["lm loss"] for r in reports], config.calculate_per_token_loss, pg),
            "grad_replica_spread": torch.tensor(max(spread.values())),
            **{f"grad/{k}": v for k, v in grads.items()}}
