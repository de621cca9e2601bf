"""The GPT with multi-latent attention (DeepSeek's MLA): megatron-core's ``MLASelfAttention``
from an ``MLATransformerConfig``, one training step as the GPT's
(:func:`~shardcheck.megatron.scenarios.gpt.train_step`).

Its layers come from the GPT layer specs with ``multi_latent_attention=True``: the local spec
(every projection a ``ColumnParallelLinear``, the down projections' outputs gathered over tp by
MLA itself), or Transformer Engine's (the down projections replicated ``TELinear``; with
``mla_down_proj_fusion`` the fused ``FusedMLASelfAttention``, whose one down projection is a
``TELayerNormColumnParallelLinear``). megatron-core's local spec does not build: its
``DotProductAttention`` takes no ``k_channels``/``v_channels``, which ``MultiLatentAttention``
passes its core attention (the query and key heads are wider than the value heads), so the
scenario runs on Transformer Engine only (:func:`check_setup`). MLA applies its own rotary embedding (YaRN by default)
inside the attention, so ``GPTModel`` builds none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from shardcheck.megatron.cpu.parallel import LayoutUnsupported
from shardcheck.megatron.scenarios.gpt import GPTSetup, train_step

Q_LORA_RANK = 16


@dataclass(frozen=True)
class MLASetup(GPTSetup):
    """The tiny GPT's sizes, data and options with MLA; ``compressed_query``: queries through
    the low-rank down and up projections (``q_lora_rank`` set), else one projection
    (``q_lora_rank=None``, as DeepSeek-V2-Lite)."""

    compressed_query: bool = True
    position_embedding: str = "rope"  # applied by MLA itself (GPTModel skips it with MLA)
    impl: Literal["local", "te"] = "te"  # Transformer Engine only: see check_setup
    # latent ranks and head sizes for the hidden size of 32 and 4 heads, each divisible by tp=2
    # where Megatron shards it; YaRN scaling as DeepSeek-V3's config gives it, to the tiny length
    base_config: ClassVar[dict[str, Any]] = {
        "multi_latent_attention": True, "kv_lora_rank": 16, "qk_head_dim": 8,
        "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "normalization": "RMSNorm",
        "rope_type": "yarn", "rotary_scaling_factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 1.0}

    def config_type(self) -> type:
        """megatron-core's ``MLATransformerConfig``."""
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def derived_config(self) -> dict[str, Any]:
        """Its query's latent rank (None: no query compression)."""
        return {"q_lora_rank": Q_LORA_RANK if self.compressed_query else None}


LOCAL_SPEC_FAILS = ("MLA runs on Transformer Engine only: megatron-core's local spec builds its "
                    "DotProductAttention, which takes no k_channels/v_channels (MultiLatentAttention "
                    "passes them; the query and key heads are wider than the value heads)")

NO_CP_ATTENTION = ("Transformer Engine selects no attention backend for MLA under context parallelism "
                   "on a CPU: in fp32 none takes CP, in bf16 it raises 'No dot product attention "
                   "backend is available' (its query and key heads are wider than its value heads)")


def check_layout(layout: Any) -> None:
    """Refuse context parallelism (:data:`NO_CP_ATTENTION`) before any rank starts."""
    if layout.cp > 1:
        raise LayoutUnsupported(NO_CP_ATTENTION)


def check_setup(setup: MLASetup) -> None:
    """Refuse, before any layer is built, megatron-core's local layers
    (:data:`LOCAL_SPEC_FAILS`) and heterogeneous layers (their config class is not MLA's)."""
    if setup.impl != "te":
        raise ValueError(LOCAL_SPEC_FAILS)
    if setup.heterogeneous:
        raise ValueError("heterogeneous layers take a HeterogeneousTransformerConfig, which is no "
                         "MLATransformerConfig: megatron-core builds no MLA from block configs")


def mla_step(ctx: Any, setup: MLASetup) -> dict[str, torch.Tensor]:
    """One training step of the MLA GPT on ``ctx``'s layout; global values by name."""
    check_setup(setup)
    check_layout(ctx.layout)
    return train_step(ctx, setup)
