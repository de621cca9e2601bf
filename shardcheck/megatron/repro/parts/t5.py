"""A T5 training step."""

from __future__ import annotations

import torch
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.models.T5.t5_spec import (
    decoder_model_with_local_spec,
    encoder_model_with_local_spec,
)

from shardcheck.megatron.repro.parts.base import config_for
from shardcheck.megatron.repro.parts.script import SETUP
from shardcheck.megatron.repro.parts.training import train


def batches():
    """The microbatches: encoder and decoder tokens, labels, the loss mask and megatron's
    attention masks (True = masked out; padded encoder positions masked for both attentions)."""
    gen = torch.Generator().manual_seed(2000)
    mb, b, enc, dec = SETUP["microbatches"], SETUP["micro_batch"], SETUP["encoder_seq"], SETUP["decoder_seq"]
    encoder_ids = torch.randint(0, SETUP["vocab"], (mb, b, enc), generator=gen)
    decoder_ids, labels = (torch.randint(0, SETUP["vocab"], (mb, b, dec), generator=gen) for _ in range(2))
    lengths = torch.randint(enc // 2, enc + 1, (mb, b), generator=gen) if SETUP["encoder_padding"] else torch.full((mb, b), enc)
    padded = (torch.arange(enc) >= lengths[..., None])[:, :, None, None, :]  # [mb, b, 1, 1, enc]
    causal = torch.ones(dec, dec, dtype=torch.bool).triu(1).expand(b, 1, dec, dec)
    mask = (torch.rand(mb, b, dec, generator=gen) < 0.6).float() if SETUP["loss_mask"] else torch.ones(mb, b, dec)
    return [dict(encoder_input_ids=encoder_ids[i], decoder_input_ids=decoder_ids[i], lm_labels=labels[i],
                 loss_mask=mask[i], encoder_attn_mask=padded[i].expand(b, 1, enc, enc), decoder_attn_mask=causal,
                 encoder_decoder_attn_mask=padded[i].expand(b, 1, dec, enc)) for i in range(mb)]


def run(sizes, pg):
    """One training step of a T5Model (local specs; the decoder cross-attends to the encoder
    output) through the schedules."""
    config = config_for(sizes, num_layers=SETUP["layers"], num_attention_heads=SETUP["heads"])
    model = T5Model(config=config, encoder_config=config, transformer_encoder_layer_spec=encoder_model_with_local_spec(),
                    transformer_decoder_layer_spec=decoder_model_with_local_spec(), vocab_size=SETUP["vocab"],
                    max_sequence_length=max(SETUP["encoder_seq"], SETUP["decoder_seq"]), pg_collection=pg,
                    share_embeddings_and_output_weights=SETUP["share_embeddings"],
                    position_embedding_type=SETUP["position_embedding"], **SETUP.get("model_args", {}))
    return train(sizes, pg, config, model, batches(), SETUP["decoder_seq"], lambda model, batch: (
        model(**{name: value for name, value in batch.items() if name != "loss_mask"},
              **SETUP.get("forward_args", {})), batch["loss_mask"]))
