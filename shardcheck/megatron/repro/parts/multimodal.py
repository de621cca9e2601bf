"""A LLaVA training step."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.multimodal.llava_model import DEFAULT_IMAGE_TOKEN_INDEX, LLaVAModel
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.transformer.mlp import MLPSubmodules

from shardcheck.megatron.repro.parts.base import config_for
from shardcheck.megatron.repro.parts.script import SETUP
from shardcheck.megatron.repro.parts.training import train


def batches():
    """The microbatches: token ids with one image token per sample (none in the last one with
    text_only_sample), images, labels, loss mask and positions; text and image's embeddings
    make ``combined_seq`` tokens."""
    gen = torch.Generator().manual_seed(3000)
    b, size = SETUP["micro_batch"], SETUP["image_size"]
    text = SETUP["combined_seq"] + 1 - (size // SETUP["patch"]) ** 2 - SETUP["keep_class_token"]
    with_image = b - SETUP["text_only_sample"]
    microbatches = []
    for _ in range(SETUP["microbatches"]):
        ids, labels = (torch.randint(0, SETUP["vocab"], (b, text), generator=gen) for _ in range(2))
        ids[torch.arange(with_image), torch.randint(0, text, (with_image,), generator=gen)] = DEFAULT_IMAGE_TOKEN_INDEX
        mask = (torch.rand(b, text, generator=gen) < 0.6).float() if SETUP["loss_mask"] else torch.ones(b, text)
        microbatches.append(dict(input_ids=ids, labels=labels, loss_mask=mask,
                                 images=torch.randn(with_image, 3, size, size, generator=gen),
                                 position_ids=torch.arange(text).expand(b, text).contiguous()))
    return microbatches


def run(sizes, pg):
    """One training step of a LLaVAModel (a CLIP ViT, its projection, the image embeddings
    scattered into the text's) through the schedules; vision and projection run without SP."""
    language, vision, projection = (config_for({**sizes, "sp": sp}, num_layers=SETUP["layers"],
                                               num_attention_heads=SETUP["heads"])
                                    for sp in (sizes["sp"], False, False))
    vision.vision_model_type = "clip"
    model = LLaVAModel(
        language_transformer_config=language, language_transformer_layer_spec=get_gpt_layer_local_spec(),
        language_vocab_size=SETUP["vocab"], language_max_sequence_length=SETUP["combined_seq"],
        vision_transformer_config=vision, vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=not SETUP["keep_class_token"], vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=tensor_parallel.ColumnParallelLinear,
                                                   linear_fc2=tensor_parallel.RowParallelLinear),
        vision_projection_type=SETUP["projection"], img_h=SETUP["image_size"], img_w=SETUP["image_size"],
        patch_dim=SETUP["patch"], pg_collection=pg, **SETUP.get("model_args", {}))
    model.model_type = ModelType.encoder_or_decoder  # as Megatron-LM's get_model sets it
    # LLaVA returns the per-token losses and the loss mask, shifted with the image's positions
    return train(sizes, pg, language, model, batches(), SETUP["combined_seq"], lambda model, batch: model(
        batch["images"], batch["input_ids"], batch["position_ids"], None, labels=batch["labels"],
        loss_mask=batch["loss_mask"], **SETUP.get("forward_args", {})))
