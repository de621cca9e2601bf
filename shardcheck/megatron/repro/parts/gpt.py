"""A GPT (MoE, MTP) training step."""

from __future__ import annotations

import inspect

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.utils import get_batch_on_this_cp_rank

from shardcheck.megatron.repro.parts.base import config_for
from shardcheck.megatron.repro.parts.cp_attention import ContextParallelAttention
from shardcheck.megatron.repro.parts.script import SETUP
from shardcheck.megatron.repro.parts.training import train


def batches(pg):
    """The microbatches, each cut for this rank's CP rank by megatron."""
    gen = torch.Generator().manual_seed(1000)
    shape = (SETUP["microbatches"], SETUP["micro_batch"], SETUP["seq"])
    tokens, labels = (torch.randint(0, SETUP["vocab"], shape, generator=gen) for _ in range(2))
    mask = (torch.rand(shape, generator=gen) < 0.6).float() if SETUP["loss_mask"] else torch.ones(shape)
    positions = torch.arange(SETUP["seq"]).expand(shape[1:]).contiguous()
    release = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}
    return [get_batch_on_this_cp_rank(dict(tokens=tokens[i], labels=labels[i], loss_mask=mask[i],
                                           position_ids=positions), cp_group=pg.cp, **release) for i in range(len(tokens))]


def run(sizes, pg):
    """One GPT training step through the schedules."""
    config = config_for(sizes, num_layers=SETUP["layers"], num_attention_heads=SETUP["heads"], mtp_num_layers=SETUP.get("mtp_layers"))
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm,
                                    normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
    if sizes["cp"] > 1:
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if config.mtp_num_layers else None
    model = GPTModel(config, spec, SETUP["vocab"], SETUP["seq"], pg_collection=pg,
                     pre_process=pg.pp.rank() == 0, post_process=pg.pp.rank() == pg.pp.size() - 1,
                     position_embedding_type=SETUP["position_embedding"], mtp_block_spec=mtp,
                     share_embeddings_and_output_weights=SETUP["share_embeddings"], **SETUP.get("model_args", {}))
    return train(sizes, pg, config, model, batches(pg), SETUP["seq"], lambda model, batch: (model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **SETUP.get("forward_args", {})), batch["loss_mask"]))
