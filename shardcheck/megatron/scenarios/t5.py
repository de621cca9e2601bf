"""T5 encoder-decoder with cross attention: ``T5Model`` (local spec) through Megatron's schedules.

One training step (forward, backward, ``finalize_model_grads``) of a tiny T5 whose decoder
layers cross-attend to the encoder output under an encoder-decoder mask; encoder padding, when
asked, masks the padded encoder positions in both the encoder's self-attention and the
decoder's cross attention. Outputs are global: the loss, every parameter's gradient and the
encoder output of every microbatch (the module output cross attention reads).

Pipeline and context parallelism are refused: T5 under pipeline parallelism puts encoder and
decoder on separate stages (``add_encoder``/``add_decoder``, the decoder stages receiving the
encoder output too), which this scenario does not build; and megatron-core's torch attention
refuses context parallelism (only Transformer Engine has it).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.models.T5.t5_model import T5Model

from shardcheck.megatron.cpu.parallel import LayoutUnsupported, explicit_kwargs, megatron_parallel
from shardcheck.megatron.scenarios.gpt import GPTSetup, masked_loss, transformer_config
from shardcheck.megatron.scenarios.reference import load_global_weights
from shardcheck.megatron.scenarios.training import (
    data_parallel_share,
    gathered_microbatches,
    global_results,
    recorded,
    schedule_step,
)

PositionEmbedding = typing.get_type_hints(T5Model.__init__)["position_embedding_type"]


@dataclass(frozen=True)
class T5Setup:
    """Sizes, data and options of the tiny T5 (TransformerConfig options are swept on ``gpt``)."""

    hidden: int = 16
    heads: int = 4
    layers: int = 1
    vocab: int = 32
    encoder_seq: int = 8
    decoder_seq: int = 8
    micro_batch: int = 2
    microbatches: int = 2
    encoder_padding: bool = False
    loss_mask: bool = False
    share_embeddings: bool = False
    position_embedding: PositionEmbedding = "learned_absolute"  # type: ignore[valid-type]
    seed: int = 0
    # T5Model's own constructor and forward arguments, swept as ``T5Model[.forward].<arg>``
    model_args: dict[str, Any] = field(default_factory=dict)
    forward_args: dict[str, Any] = field(default_factory=dict)


def check_layout(layout: Any) -> None:
    """Refuse the layouts the T5 scenario cannot run as Megatron would."""
    if layout.pp > 1:
        raise LayoutUnsupported("T5 under pipeline parallelism puts encoder and decoder on "
                                "separate stages (add_encoder/add_decoder), which this scenario "
                                "does not build")
    if layout.cp > 1:
        raise LayoutUnsupported("cross attention under context parallelism needs Transformer "
                                "Engine (megatron-core's DotProductAttention refuses cp > 1)")


def _masks(setup: T5Setup, encoder_valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Megatron's boolean attention masks ([b, 1, sq, sk], True = masked out)."""
    dec = setup.decoder_seq
    causal = torch.ones(dec, dec, dtype=torch.bool).triu(1)
    padded_keys = ~encoder_valid[:, None, None, :]
    batch = encoder_valid.size(0)
    return dict(
        encoder_attn_mask=padded_keys.expand(batch, 1, setup.encoder_seq, setup.encoder_seq),
        decoder_attn_mask=causal.expand(batch, 1, dec, dec),
        encoder_decoder_attn_mask=padded_keys.expand(batch, 1, dec, setup.encoder_seq))


def global_batches(setup: T5Setup) -> list[dict[str, torch.Tensor]]:
    """All microbatches, identical on every rank and in every layout."""
    gen = torch.Generator().manual_seed(2000 + setup.seed)
    mb, b = setup.microbatches, setup.micro_batch
    encoder_ids = torch.randint(0, setup.vocab, (mb, b, setup.encoder_seq), generator=gen)
    decoder_ids = torch.randint(0, setup.vocab, (mb, b, setup.decoder_seq), generator=gen)
    labels = torch.randint(0, setup.vocab, (mb, b, setup.decoder_seq), generator=gen)
    lengths = torch.randint(setup.encoder_seq // 2, setup.encoder_seq + 1, (mb, b), generator=gen)
    if not setup.encoder_padding:
        lengths.fill_(setup.encoder_seq)
    valid = torch.arange(setup.encoder_seq) < lengths[..., None]
    shape = (mb, b, setup.decoder_seq)
    mask = (torch.rand(shape, generator=gen) < 0.6).float() if setup.loss_mask else torch.ones(shape)
    return [dict(encoder_input_ids=encoder_ids[i], decoder_input_ids=decoder_ids[i],
                 lm_labels=labels[i], loss_mask=mask[i], **_masks(setup, valid[i]))
            for i in range(mb)]


def build_t5(config, setup: T5Setup, pg: Any = None) -> T5Model:
    """A T5Model with megatron-core's local encoder and decoder layer specs."""
    from megatron.core.models.T5.t5_spec import (
        decoder_model_with_local_spec,
        encoder_model_with_local_spec,
    )

    return T5Model(
        config=config, encoder_config=config,
        transformer_encoder_layer_spec=encoder_model_with_local_spec(),
        transformer_decoder_layer_spec=decoder_model_with_local_spec(),
        vocab_size=setup.vocab, max_sequence_length=max(setup.encoder_seq, setup.decoder_seq),
        share_embeddings_and_output_weights=setup.share_embeddings,
        position_embedding_type=setup.position_embedding, **setup.model_args, **explicit_kwargs(pg))


def _forward_step(batches: list[dict[str, torch.Tensor]], forward_args: dict[str, Any]):
    batch_iter = iter(batches)

    def forward_step(_data_iterator, model):
        batch = next(batch_iter)
        inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
        return model(**inputs, **forward_args), lambda out: masked_loss(batch, out)

    return forward_step


def t5_step(ctx: Any, setup: T5Setup) -> dict[str, torch.Tensor]:
    """One T5 training step under ``ctx``'s layout; global values by name."""
    check_layout(ctx.layout)
    with megatron_parallel(ctx) as pg:
        config = transformer_config(ctx.layout, GPTSetup(hidden=setup.hidden, heads=setup.heads,
                                                         layers=setup.layers))
        model = build_t5(config, setup, pg)
        load_global_weights(model, seed=setup.seed)
        batches = data_parallel_share(global_batches(setup), pg)
        with recorded(model.encoder, lambda out: out) as encoder_outputs:
            reports = schedule_step(config, model, _forward_step(batches, setup.forward_args), batches,
                                    setup.decoder_seq, setup.micro_batch, pg)
        return {**global_results(ctx, model, config, reports, pg),
                "encoder_output": gathered_microbatches(encoder_outputs, ctx.layout.sp, pg)}
