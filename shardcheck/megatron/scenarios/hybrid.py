"""Megatron's ``HybridModel`` end to end: Mamba, Gated DeltaNet, attention, MLP or MoE layers and
an MTP depth, one training step as the GPT's (:func:`~shardcheck.megatron.scenarios.gpt.train_step`).

megatron-core 0.19.2 deprecates ``GPTModel`` for ``HybridModel``, which builds its layers from a
pattern of Megatron's symbols (``M`` Mamba, ``G`` Gated DeltaNet, ``*`` attention, ``-`` MLP,
``E`` MoE; an MTP depth after ``/``) on megatron-core's hybrid stack spec. That spec is
Transformer Engine's and ``HybridStack`` builds its final norm with ``TENorm`` whatever the spec
says, and megatron-core has no local hybrid spec: so the scenario runs on Transformer Engine only
(``impl="te"`` is its default, and the audit runs its cases on the TE host's pools).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from shardcheck.megatron.cpu.parallel import LayoutUnsupported, explicit_kwargs, scenario_groups
from shardcheck.megatron.scenarios.gpt import GPTSetup, train_step

# The layer patterns swept: every kind of layer the hybrid stack builds on a CPU (not ``D``,
# DeepSeek sparse attention, whose indexer is a CUDA kernel, nor ``+``, multi-latent attention)
# and one MTP depth of Mamba and attention. The first has a dense MLP where the second has MoE,
# since Megatron's MoE layer refuses tensor parallelism without sequence parallelism in training.
Pattern = Literal["MG*-/M*", "MG*E/M*"]
# The first words of the audit's refusal of one option under a layout (``outcome.CONFIG_REFUSES``),
# which closes that option there and not the layout: the scenario sits below the audit.
REFUSED = "megatron-core refuses it"


@dataclass(frozen=True)
class HybridSetup(GPTSetup):
    """The tiny GPT's sizes, data and options as a ``HybridModel`` of ``pattern``'s layers on
    Transformer Engine; ``config`` overrides TransformerConfig."""

    pattern: Pattern = "MG*-/M*"
    layers: int = 4  # the pattern's decoder layers
    position_embedding: str = "rope"  # learned absolute positions with MTP: Megatron-LM refuses them
    impl: Literal["local", "te"] = "te"
    # Mamba (d_inner 64: 16 heads of 4 in Megatron's 8 groups), Gated DeltaNet (8 value heads
    # over 4 key heads of 4; Megatron's convolution of 4) and MoE sizes for the hidden size of
    # 32; RMSNorm and SiLU (GDN's convolution); the MTP depth of every pattern
    base_config: ClassVar[dict[str, Any]] = {
        "mamba_state_dim": 4, "mamba_head_dim": 4, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8,
        "normalization": "RMSNorm", "activation_func": torch.nn.functional.silu,
        "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
        "add_bias_linear": False, "mtp_num_layers": 1}
    # its Mamba and GDN layers' gradients checked where the SSM scenarios check them, so a
    # layer's bug reached through the model is located at the same line
    gradients_where_built: ClassVar[bool] = True

    def build_model(self, config: Any, pg: Any = None) -> Any:
        """The ``HybridModel`` of this pipeline stage."""
        return build_hybrid(config, self, pg)


def stack_spec(grouped_gemm: bool = False) -> Any:
    """megatron-core's hybrid stack spec. Its MoE layers hold Transformer Engine's grouped-GEMM
    experts; without ``grouped_gemm`` (a CPU has none) they hold megatron-core's MoE spec
    without it, as the GPT layer specs do."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    if grouped_gemm:
        return hybrid_stack_spec
    moe_layer = hybrid_stack_spec.submodules.moe_layer
    experts = get_moe_module_spec(use_te=True, num_experts=8, moe_grouped_gemm=False)  # any count
    moe_layer = dataclasses.replace(moe_layer, submodules=dataclasses.replace(moe_layer.submodules, mlp=experts))
    return dataclasses.replace(hybrid_stack_spec,
                               submodules=dataclasses.replace(hybrid_stack_spec.submodules, moe_layer=moe_layer))


def build_hybrid(config: Any, setup: HybridSetup, pg: Any = None) -> Any:
    """A ``HybridModel`` of the setup's pattern for this pipeline stage (Megatron splits the
    pattern's layers over the stages)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    pp = scenario_groups(pg).pp
    return HybridModel(
        config=config, hybrid_stack_spec=stack_spec(config.moe_grouped_gemm), vocab_size=setup.vocab,
        max_sequence_length=setup.seq, hybrid_layer_pattern=setup.pattern,
        pre_process=pp.rank() == 0, post_process=pp.rank() == pp.size() - 1,
        share_embeddings_and_output_weights=setup.share_embeddings,
        position_embedding_type=setup.position_embedding,
        **setup.model_args, **explicit_kwargs(pg),
    )


def check_setup(layout: Any, setup: HybridSetup) -> None:
    """Refuse, before any layer is built, what megatron-core or Transformer Engine refuses:
    megatron-core's local layers (it has no local hybrid spec); context parallelism in fp32 (TE
    has no attention backend for it: flash and fused attention take 16 bits, its unfused
    attention no CP); MoE layers under tensor parallelism without sequence parallelism
    (``MoELayer.forward`` raises in training)."""
    if setup.impl != "te":
        raise ValueError("HybridModel runs on Transformer Engine only: megatron-core's hybrid stack "
                         "spec is TE's and HybridStack builds its final norm with TENorm")
    if setup.heterogeneous:
        raise LayoutUnsupported("HybridModel takes its layers from its pattern, not from heterogeneous block configs")
    if layout.cp > 1 and not (setup.config.get("bf16") or setup.config.get("fp16")):
        raise LayoutUnsupported("Transformer Engine has no fp32 attention under context parallelism "
                                "(flash and fused attention take 16 bits, unfused attention no CP): bf16 runs it")
    if "E" in setup.pattern and layout.tp > 1 and not layout.sp:
        raise LayoutUnsupported(f"{REFUSED}: MoELayer.forward raises a ValueError in training under "
                                "tensor parallelism without sequence parallelism")


def hybrid_step(ctx: Any, setup: HybridSetup) -> dict[str, torch.Tensor]:
    """One training step of the ``HybridModel`` on ``ctx``'s layout; global values by name."""
    check_setup(ctx.layout, setup)
    return train_step(ctx, setup)
