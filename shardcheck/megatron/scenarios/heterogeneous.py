"""The GPT's ``heterogeneous`` option: a Llama-Nemotron-style model whose layers differ.

megatron-core builds it from a ``HeterogeneousTransformerConfig``, whose ``block_configs`` (the
format of Hugging Face's Llama-Nemotron configs) give each layer's attention and MLP: the full
module with its own query groups or FFN size, none (``no_op``), or one linear layer in its place
(``replace_with_linear``: megatron-core's ``ColumnParallelLinearGathered``), turned into layer specs
by ``get_gpt_heterogeneous_layer_spec``, as Megatron-LM's ``gpt_builders.py`` does. :data:`BLOCKS`
holds every kind once: full, no attention, linear attention and MLP, no MLP.
"""

from __future__ import annotations

import json
from typing import Any

from shardcheck.megatron.cpu.parallel import LayoutUnsupported


def _block(attention: str, mlp: str) -> dict[str, Any]:
    """One block config: each part ``full``, ``none`` (no_op) or ``linear`` (replace_with_linear);
    full attention in groups of 2 heads, a full MLP of ``ffn_mult`` 1.5."""
    def part(kind: str, size: tuple[str, Any]) -> dict[str, Any]:
        return {"no_op": kind == "none", "replace_with_linear": kind == "linear",
                size[0]: size[1] if kind == "full" else None}

    return {"attention": part(attention, ("n_heads_in_group", 2)), "ffn": part(mlp, ("ffn_mult", 1.5))}


BLOCKS = [_block("full", "full"), _block("none", "full"), _block("linear", "linear"), _block("full", "none")]


def config_type() -> type:
    """megatron-core's config of per-layer blocks."""
    from megatron.core.transformer.heterogeneous.heterogeneous_config import (
        HeterogeneousTransformerConfig,
    )

    return HeterogeneousTransformerConfig


def config_options() -> dict[str, Any]:
    """The config fields of :data:`BLOCKS`: one layer per block, and the blocks as JSON."""
    return {"num_layers": len(BLOCKS), "heterogeneous_layers_config_encoded_json": json.dumps({"block_configs": BLOCKS})}


def layer_specs(config: Any, transformer_engine: bool) -> Any:
    """megatron-core's heterogeneous block spec of ``config``; refused (one line) where the model
    asks for what it does not build: experts (``gpt_builders.py`` builds MoE's spec instead) or
    MTP layers (built from the decoder's last layer spec, which a block spec is not)."""
    if config.num_moe_experts or config.mtp_num_layers:
        raise LayoutUnsupported("megatron-core's heterogeneous layer spec builds neither experts nor MTP layers "
                                "(Megatron-LM's gpt_builders.py builds the MoE spec instead)")
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (
        get_gpt_heterogeneous_layer_spec,
    )

    from shardcheck.megatron.cpu.cp_attention import local_spec_for

    spec = get_gpt_heterogeneous_layer_spec(config, transformer_engine)
    if not transformer_engine:
        spec.layer_specs = [local_spec_for(config, layer) for layer in spec.layer_specs]
    return spec
