"""A training step through megatron's schedules, DDP and optimizer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

from shardcheck.megatron.repro.parts.moe_metrics import moe_metrics
from shardcheck.megatron.repro.parts.script import SETUP
from shardcheck.megatron.repro.parts.weights import grad_norms, load_weights


def train(sizes, pg, config, model, microbatches, seq, losses):
    """A training step on this rank's data-parallel share of the microbatches (all in the reference), ``losses(model,
    batch)`` giving per-token losses and mask: [the optimizer's gradient norm, the loss sum, every gradient's norm,
    the MoE metrics megatron's training loop logs]."""
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    load_weights(model, pg)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model, pg_collection=pg)
    config.finalize_model_grads_func, config.no_sync_func = finalize_model_grads, ddp.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.5, clip_grad=SETUP.get("clip_grad", 1.0)),
                                       [ddp], use_gloo_process_groups=False, pg_collection=pg)
    def forward_step(data, model):  # megatron's: its loss function gives the masked sum, the count, a report
        output, mask = losses(model, next(data))
        def loss_function(out):
            loss_sum = (out.float().reshape(-1) * mask.reshape(-1).float()).sum()
            return loss_sum, mask.sum().to(torch.int), {"lm loss": loss_sum.detach().clone()}  # megatron divides loss_sum in place
        return output, loss_function
    mine = microbatches if sizes["whole_batch"] else microbatches[pg.dp.rank()::pg.dp.size()]
    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mine), model=[ddp], num_microbatches=len(mine),
        seq_length=seq, micro_batch_size=SETUP["micro_batch"], forward_only=False, pg_collection=pg,
        p2p_communicator=P2PCommunicator(pp_group=pg.pp, config=config))
    loss = torch.stack([report["lm loss"] for report in reports]).sum().view(1) if reports else torch.zeros(1)
    if not sizes["whole_batch"]:  # each data-parallel (and CP) rank holds its part of the batch
        dist.all_reduce(loss, group=pg.dp_cp)
    dist.all_reduce(loss, group=pg.pp)  # the last stage's
    norms = grad_norms(model, pg)
    metrics = moe_metrics(config, len(mine), pg) if config.num_moe_experts else torch.zeros(0)
    _, grad_norm, _ = optimizer.step()
    counted = {id(grad) for chained in getattr(optimizer, "chained_optimizers", [optimizer])  # after the step
               for grad in (getattr(chained, "get_grads_for_grad_norm", None) or chained.get_main_grads_for_grad_norm)()}
    return torch.cat([torch.tensor([float(grad_norm)]), loss, norms, grad_norms(model, pg, counted), metrics])

