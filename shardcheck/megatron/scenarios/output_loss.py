"""The output layer and the loss: ColumnParallelLinear logits into vocab-parallel cross-entropy.

Mirrors ``LanguageModule.compute_language_model_loss`` (the unfused path) with the options it
does not expose: label smoothing, ``parallel_output`` (``gather_output``) and
``runtime_gather_output``. Outputs are global: the mean loss, the output weight's gradient and
the hidden states' gradient. Under explicit groups the layer gets the explicit ``tp_group``
(the cross-entropy gets it too where the release takes it, as ``LanguageModule`` gives it in
0.19; 0.16's reads ``parallel_state``'s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.megatron.checks.typecheck import harness_typed
from shardcheck.megatron.cpu.parallel import explicit_kwargs, megatron_parallel, world_group
from shardcheck.megatron.cpu.versions import tp_group_kwargs
from shardcheck.megatron.scenarios.gpt import GPTSetup, transformer_config
from shardcheck.megatron.scenarios.reference import (
    gather_global,
    load_global_weights,
    seeded_global,
)
from shardcheck.typecheck.types import S


@dataclass(frozen=True)
class OutputLossSetup:
    """Sizes and the loss options of the output-layer scenario."""

    hidden: int = 16
    vocab: int = 64
    seq: int = field(default=8, metadata={"fuzz": (4, 8, 16)})
    batch: int = field(default=2, metadata={"fuzz": (1, 2)})
    label_smoothing: float = 0.0
    parallel_output: bool = True
    runtime_gather_output: bool | None = None
    seed: int = 0


def _tp_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    from megatron.core import parallel_state as ps

    return group if group is not None else ps.get_tensor_model_parallel_group()


def _sequence_shard(tensor: torch.Tensor, sp: bool, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This TP rank's sequence chunk under sequence parallelism (on ``group``, by default
    ``parallel_state``'s tp group; S(0) over tp), else the whole tensor."""
    if not sp:
        return tensor
    group = _tp_group(group)
    return harness_typed(tensor.chunk(group.size(), dim=0)[group.rank()], tp=S(0))


def _sequence_gather(tensor: torch.Tensor, sp: bool, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    if not sp:
        return tensor
    group = _tp_group(group)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def output_loss(ctx: Any, setup: OutputLossSetup) -> dict[str, torch.Tensor]:
    """Loss and gradients of the output layer + vocab-parallel cross-entropy under ``ctx``."""
    from megatron.core import tensor_parallel

    with megatron_parallel(ctx) as pg:
        tp = pg.tp if pg is not None else None
        config = transformer_config(ctx.layout, GPTSetup(hidden=setup.hidden, heads=4, layers=1))
        layer = tensor_parallel.ColumnParallelLinear(
            setup.hidden, setup.vocab, config=config, init_method=config.init_method,
            bias=False, gather_output=not setup.parallel_output, **explicit_kwargs(tp, "tp_group"))
        load_global_weights(layer, seed=setup.seed)
        hidden = seeded_global("hidden", (setup.seq, setup.batch, setup.hidden), setup.seed) * 20
        labels = torch.randint(0, setup.vocab, (setup.seq, setup.batch),
                               generator=torch.Generator().manual_seed(setup.seed))
        local_hidden = _sequence_shard(hidden.float(), ctx.layout.sp, tp).requires_grad_(True)
        logits, _ = layer(local_hidden, runtime_gather_output=setup.runtime_gather_output)
        losses = tensor_parallel.vocab_parallel_cross_entropy(
            logits.float().clone(), labels, label_smoothing=setup.label_smoothing,
            **tp_group_kwargs(tensor_parallel.vocab_parallel_cross_entropy, tp))
        loss = losses.mean()
        loss.backward()
        grads, _ = gather_global(layer, lambda p: p.grad, world_group(ctx))
        return {"loss": loss.detach(),
                "hidden_grad": _sequence_gather(local_hidden.grad, ctx.layout.sp, tp),
                **{f"grad/{k}": v for k, v in grads.items()}}
