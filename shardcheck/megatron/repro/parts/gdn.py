"""A GatedDeltaNet layer's forward, backward and gradient finalisation."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from shardcheck.megatron.repro.parts.base import config_for
from shardcheck.megatron.repro.parts.script import SETUP
from shardcheck.megatron.repro.parts.seeded import seeded
from shardcheck.megatron.repro.parts.shard import shard
from shardcheck.megatron.repro.parts.weights import grad_norms, load_weights


def run(sizes, pg):
    """A GatedDeltaNet layer's forward and backward, then finalize_model_grads: the norm of every
    gradient (a replicated one on each rank: replicas must agree)."""
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = config_for(sizes, experimental_attention_variant="gated_delta_net", linear_attention_freq=1,
                        linear_conv_kernel_dim=SETUP["conv_kernel"], linear_key_head_dim=SETUP["head_dim"],
                        linear_value_head_dim=SETUP["head_dim"], linear_num_key_heads=SETUP["key_heads"],
                        linear_num_value_heads=SETUP["value_heads"], normalization="RMSNorm",
                        activation_func=torch.nn.functional.silu)
    layer = GatedDeltaNet(config, GatedDeltaNetSubmodules(
        in_proj=tensor_parallel.ColumnParallelLinear, out_norm=WrappedTorchNorm,
        out_proj=tensor_parallel.RowParallelLinear), layer_number=1, bias=SETUP["bias"],
        conv_bias=SETUP["conv_bias"], use_qk_l2norm=SETUP["use_qk_l2norm"], pg_collection=pg)
    load_weights(layer, pg)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), layer, pg_collection=pg)
    shape = (SETUP["seq"], SETUP["batch"], SETUP["hidden"])
    hidden = shard(seeded("hidden", *shape), sizes, pg.tp).requires_grad_(True)
    output, _ = layer(hidden, attention_mask=None)
    (output * shard(seeded("upstream", *shape), sizes, pg.tp)).sum().backward()
    finalize_model_grads([ddp], pg_collection=pg)
    return grad_norms(layer, pg)
