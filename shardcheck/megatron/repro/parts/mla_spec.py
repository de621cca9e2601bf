"""A GPT decoder layer's spec with multi-latent attention: Transformer Engine's, the only spec
that builds it (the fused down projection from megatron-core 0.19 on)."""

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

from shardcheck.megatron.repro.parts.script import OVERRIDES


def layer_spec(config):
    fused = {"mla_down_proj_fusion": True} if OVERRIDES.get("mla_down_proj_fusion") else {}
    return get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True, **fused)
