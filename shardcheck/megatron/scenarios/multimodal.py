"""The multimodal embedding path: ``LLaVAModel`` (local specs) through Megatron's schedules.

A tiny CLIP ViT encodes each image, the vision projection maps it to the language model's
width, and LLaVA's ``_preprocess_data`` scatters the image embeddings into the text embeddings
at the image-token positions (shifting labels and the loss mask with them), then
``_process_embedding_token_parallel`` cuts the combined sequence for sequence parallelism.
One training step (forward, backward, ``finalize_model_grads``); outputs are global: the loss,
every parameter's gradient and the combined embeddings of every microbatch.

The text length is chosen so the combined sequence has ``combined_seq`` tokens whatever the
image length, as sequence parallelism needs a length divisible by tp. The vision encoder and
projection run without sequence parallelism (LLaVA feeds them whole images).

Pipeline and context parallelism are refused: LLaVA splits vision encoder and language model
over pipeline stages (``add_encoder``/``add_decoder``) with its own schedule arguments, and its
context-parallel path imports ``megatron.training``, which megatron-core does not ship.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

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

IMAGE_TOKEN = -200
# MultimodalProjector's projector types (Megatron types the argument as a plain str)
Projection = Literal["mlp", "affine"]


@dataclass(frozen=True)
class MultimodalSetup:
    """Sizes, data and options of the tiny LLaVA."""

    hidden: int = 16
    heads: int = 4
    layers: int = 1
    vocab: int = 32
    combined_seq: int = 12
    image_size: int = 8
    patch: int = 4
    micro_batch: int = 2
    microbatches: int = 2
    keep_class_token: bool = False
    text_only_sample: bool = False
    loss_mask: bool = False
    projection: Projection = "mlp"
    seed: int = 0
    # LLaVAModel's own constructor and forward arguments, swept as ``LLaVAModel[.forward].<arg>``
    model_args: dict[str, Any] = field(default_factory=dict)
    forward_args: dict[str, Any] = field(default_factory=dict)

    @property
    def image_seq(self) -> int:
        """Embeddings per image: one per patch, plus the class token when kept; a quarter of
        them under ``pixel_shuffle`` (it folds each 2x2 of patches into one)."""
        embeddings = (self.image_size // self.patch) ** 2 + int(self.keep_class_token)
        return embeddings // 4 if self.model_args.get("pixel_shuffle") else embeddings

    @property
    def text_seq(self) -> int:
        """Text tokens (one of them the image token) that make ``combined_seq`` with an image."""
        return self.combined_seq - self.image_seq + 1


def check_layout(layout: Any) -> None:
    """Refuse the layouts the LLaVA scenario cannot run as Megatron would."""
    if layout.pp > 1:
        raise LayoutUnsupported("LLaVA under pipeline parallelism splits the vision encoder and "
                                "the language model over stages, which this scenario does not do")
    if layout.cp > 1:
        raise LayoutUnsupported("LLaVA's context-parallel path imports megatron.training "
                                "(not part of megatron-core) and needs Transformer Engine")


def global_batches(setup: MultimodalSetup) -> list[dict[str, torch.Tensor]]:
    """All microbatches: token ids with one image token per sample (none in the last sample
    with ``text_only_sample``), images, labels and the text loss mask."""
    gen = torch.Generator().manual_seed(3000 + setup.seed)
    batches = []
    for _ in range(setup.microbatches):
        shape = (setup.micro_batch, setup.text_seq)
        ids = torch.randint(0, setup.vocab, shape, generator=gen)
        with_image = setup.micro_batch - int(setup.text_only_sample)
        where = torch.randint(0, setup.text_seq, (with_image,), generator=gen)
        ids[torch.arange(with_image), where] = IMAGE_TOKEN
        images = torch.randn(with_image, 3, setup.image_size, setup.image_size, generator=gen)
        mask = (torch.rand(shape, generator=gen) < 0.6).float() if setup.loss_mask else torch.ones(shape)
        batches.append(dict(input_ids=ids, images=images, loss_mask=mask,
                            labels=torch.randint(0, setup.vocab, shape, generator=gen),
                            position_ids=torch.arange(setup.text_seq).expand(shape).contiguous()))
    return batches


def build_llava(ctx: Any, setup: MultimodalSetup, pg: Any = None):
    """A LLaVAModel with local GPT and CLIP ViT layer specs and an MLP (or affine) projection."""
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    sizes = GPTSetup(hidden=setup.hidden, heads=setup.heads, layers=setup.layers)
    language = transformer_config(ctx.layout, sizes)
    vision = transformer_config(ctx.layout, sizes, sequence_parallel=False)
    vision.vision_model_type = "clip"
    projection = transformer_config(ctx.layout, sizes, sequence_parallel=False)
    model = LLaVAModel(
        language_transformer_config=language,
        language_transformer_layer_spec=get_gpt_layer_local_spec(),
        language_vocab_size=setup.vocab, language_max_sequence_length=setup.combined_seq,
        vision_transformer_config=vision,
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=not setup.keep_class_token,
        vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                   linear_fc2=RowParallelLinear),
        vision_projection_type=setup.projection,
        img_h=setup.image_size, img_w=setup.image_size, patch_dim=setup.patch, **setup.model_args,
        **explicit_kwargs(pg))
    model.model_type = ModelType.encoder_or_decoder  # set by Megatron-LM's get_model, as here
    return model, language


def _forward_step(batches: list[dict[str, torch.Tensor]], forward_args: dict[str, Any]):
    batch_iter = iter(batches)

    def forward_step(_data_iterator, model):
        batch = next(batch_iter)
        output, loss_mask = model(batch["images"], batch["input_ids"], batch["position_ids"],
                                  None, labels=batch["labels"], loss_mask=batch["loss_mask"],
                                  **forward_args)
        return output, lambda out: masked_loss({"loss_mask": loss_mask}, out)

    return forward_step


def multimodal_step(ctx: Any, setup: MultimodalSetup) -> dict[str, torch.Tensor]:
    """One LLaVA training step under ``ctx``'s layout; global values by name."""
    check_layout(ctx.layout)
    with megatron_parallel(ctx) as pg:
        model, config = build_llava(ctx, setup, pg)
        load_global_weights(model, seed=setup.seed)
        batches = data_parallel_share(global_batches(setup), pg)
        with recorded(model.language_model, lambda _args, kwargs: kwargs["decoder_input"],
                      before=True) as combined:
            reports = schedule_step(config, model, _forward_step(batches, setup.forward_args), batches,
                                    setup.combined_seq, setup.micro_batch, pg)
        return {**global_results(ctx, model, config, reports, pg),
                "combined_embeddings": gathered_microbatches(combined, ctx.layout.sp, pg)}
