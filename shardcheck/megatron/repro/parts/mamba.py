"""A Mamba-2 mixer's forward, backward and gradient finalisation."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from shardcheck.megatron.repro.parts.base import config_for
from shardcheck.megatron.repro.parts.script import SETUP, mamba_module
from shardcheck.megatron.repro.parts.seeded import seeded
from shardcheck.megatron.repro.parts.shard import shard
from shardcheck.megatron.repro.parts.weights import grad_norms, load_weights


def run(sizes, pg):
    """A Mamba-2 mixer's forward and backward, then finalize_model_grads: the norm of every gradient."""
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = config_for(sizes, mamba_state_dim=SETUP["state_dim"], mamba_head_dim=SETUP["head_dim"],
                        mamba_num_groups=SETUP["groups"])
    layer = mamba_module.MambaMixer(config, mamba_module.MambaMixerSubmodules(
        in_proj=tensor_parallel.ColumnParallelLinear, out_proj=tensor_parallel.RowParallelLinear),
        d_model=SETUP["hidden"], d_conv=SETUP["conv_kernel"], expand=SETUP["expand"],
        D_has_hdim=SETUP["d_has_hdim"], rmsnorm=SETUP["rmsnorm"], conv_bias=SETUP["conv_bias"],
        layer_number=1, pg_collection=pg)
    load_weights(layer, pg)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), layer, pg_collection=pg)
    shape = (SETUP["seq"], SETUP["batch"], SETUP["hidden"])
    hidden = tokens(seeded("hidden", *shape), sizes, pg).requires_grad_(True)
    output, _ = layer(hidden)
    # as megatron's schedules: DDP sums a per-token loss over dp x cp, else averages it (scaled by cp)
    scale = 1 / pg.dp.size() if config.calculate_per_token_loss else pg.cp.size()
    ((output * tokens(seeded("upstream", *shape), sizes, pg)).sum() * scale).backward()
    finalize_model_grads([ddp], pg_collection=pg)
    return grad_norms(layer, pg)


def tokens(tensor, sizes, pg):
    """This rank's part of a global [seq, ...] tensor: its CP chunks in megatron's load-balanced
    order (r and 2*cp-1-r of 2*cp), then its share under sequence parallelism."""
    chunks = tensor.chunk(2 * pg.cp.size())
    return shard(torch.cat([chunks[pg.cp.rank()], chunks[-1 - pg.cp.rank()]]), sizes, pg.tp)
