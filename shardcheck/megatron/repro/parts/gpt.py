"""A GPT (MoE, MTP) training step."""

from __future__ import annotations

import inspect

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.utils import get_batch_on_this_cp_rank

from shardcheck.megatron.repro.parts.base import config_for
from shardcheck.megatron.repro.parts.cp_attention import ContextParallelAttention
from shardcheck.megatron.repro.parts.local_spec import layer_spec
from shardcheck.megatron.repro.parts.script import SETUP
from shardcheck.megatron.repro.parts.training import train


def batches(pg, whole=False):
    """The microbatches, each cut for this rank's CP rank by megatron; ``whole``: all of them in one."""
    gen = torch.Generator().manual_seed(1000)
    shape = (SETUP["microbatches"], SETUP["micro_batch"], SETUP["seq"])
    tokens, labels = (torch.randint(0, SETUP["vocab"], shape, generator=gen) for _ in range(2))
    mask = (torch.rand(shape, generator=gen) < 0.6).float() if SETUP["loss_mask"] else torch.ones(shape)
    positions = torch.arange(SETUP["seq"]).expand(shape[1:]).contiguous()
    position, inputs = torch.arange(SETUP["seq"]), {}
    n = torch.arange(shape[0] * shape[1]).view(shape[0], shape[1], 1)  # each sequence's place in the batch
    if SETUP.get("padding_mask"):  # (5n + 3) mod seq/2 pad tokens (id 0, no loss) end the n-th sequence
        inputs["padding_mask"] = position >= SETUP["seq"] - (n * 5 + 3) % (SETUP["seq"] // 2)
        tokens, mask = tokens.masked_fill(inputs["padding_mask"], 0), mask.masked_fill(inputs["padding_mask"], 0.0)
    if SETUP.get("attention_mask"):  # causal, and reset where the n-th sequence's second document starts
        second = position >= (n * 3 + 5) % (SETUP["seq"] - 2) + 1
        inputs["attention_mask"] = ((position[None, :] > position[:, None])
                                    | (second[..., :, None] != second[..., None, :])).unsqueeze(2)
    microbatches = [dict(tokens=tokens[i], labels=labels[i], loss_mask=mask[i], position_ids=positions,
                         **{name: value[i] for name, value in inputs.items()}) for i in range(len(tokens))]
    if whole:
        return [{name: torch.cat([b[name] for b in microbatches]) for name in microbatches[0]}]
    release = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}
    return [get_batch_on_this_cp_rank(batch, cp_group=pg.cp, **release) for batch in microbatches]


def run(sizes, pg):
    """One GPT training step through the schedules."""
    config = config_for(sizes, num_layers=SETUP["layers"], num_attention_heads=SETUP["heads"], mtp_num_layers=SETUP.get("mtp_layers"))
    spec = layer_spec(config)  # megatron-core's local spec; Transformer Engine's for MLA
    if sizes["cp"] > 1:
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if config.mtp_num_layers else None
    model = GPTModel(config, spec, SETUP["vocab"], SETUP["seq"], pg_collection=pg,
                     pre_process=pg.pp.rank() == 0, post_process=pg.pp.rank() == pg.pp.size() - 1,
                     position_embedding_type=SETUP["position_embedding"], mtp_block_spec=mtp,
                     share_embeddings_and_output_weights=SETUP["share_embeddings"], **SETUP.get("model_args", {}))
    # per-token loss with no term over a micro-batch as a whole (MoE's z loss, aux losses but seq_aux_loss) is split-free
    kinds, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    pairs = zip(*(([kinds], [coeffs]) if isinstance(kinds, str) else (kinds, coeffs)), strict=False)
    per_micro_batch = config.moe_z_loss_coeff or any(c for kind, c in pairs if kind != "seq_aux_loss")
    whole = sizes["whole_batch"] and config.calculate_per_token_loss and not per_micro_batch
    return train(sizes, pg, config, model, batches(pg, whole), SETUP["seq"], lambda model, batch: (model(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
        loss_mask=batch["loss_mask"], padding_mask=batch.get("padding_mask"), **SETUP.get("forward_args", {})),
        batch["loss_mask"]))
