"""The output layer's logits into the vocab-parallel cross-entropy."""

from __future__ import annotations

import inspect

import torch
from megatron.core import tensor_parallel

from shardcheck.megatron.repro.parts.base import config_for
from shardcheck.megatron.repro.parts.pieces import gather
from shardcheck.megatron.repro.parts.script import SETUP
from shardcheck.megatron.repro.parts.seeded import seeded
from shardcheck.megatron.repro.parts.shard import shard


def run(sizes, pg):
    """ColumnParallelLinear logits into vocab_parallel_cross_entropy: [loss, weight grad, input grad]."""
    config = config_for(sizes)
    layer = tensor_parallel.ColumnParallelLinear(
        SETUP["hidden"], SETUP["vocab"], config=config, init_method=config.init_method, bias=False,
        gather_output=not SETUP["parallel_output"], tp_group=pg.tp)
    layer.weight.data.copy_(seeded("weight", SETUP["vocab"], SETUP["hidden"]).chunk(pg.tp.size())[pg.tp.rank()] * 0.05)
    hidden = seeded("hidden", SETUP["seq"], SETUP["batch"], SETUP["hidden"])
    labels = torch.randint(0, SETUP["vocab"], (SETUP["seq"], SETUP["batch"]),
                           generator=torch.Generator().manual_seed(0))
    local = shard(hidden, sizes, pg.tp).requires_grad_(True)
    logits, _ = layer(local, runtime_gather_output=SETUP["runtime_gather_output"])
    group = {"tp_group": pg.tp} if "tp_group" in inspect.signature(tensor_parallel.vocab_parallel_cross_entropy).parameters else {}
    loss = tensor_parallel.vocab_parallel_cross_entropy(
        logits.float().clone(), labels, label_smoothing=SETUP["label_smoothing"], **group).mean()
    loss.backward()
    grad_in = gather(local.grad, 0, pg.tp) if sizes["sp"] else local.grad
    return torch.cat([loss.detach().view(1), gather(layer.weight.grad, 0, pg.tp).flatten(),
                      grad_in.flatten()])
