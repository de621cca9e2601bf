"""A GPT decoder layer's spec: megatron-core's local spec (no Transformer Engine)."""

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec


def layer_spec(config):
    return get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm,
                                    normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
