"""Check the model ``pretrain`` built against the flags that shaped it, on every rank.

An entry point that drops a model-shaping flag builds another model than the user asked for,
and the runs then agree about that model. After ``setup_model_and_optimizer`` built the model,
:func:`mismatches` compares (a) the model's ``TransformerConfig`` with the one Megatron derives
from the arguments, field by field, and (b) the modules of each layer with those the flags ask
for (experts where ``--moe-layer-freq`` puts them, gated delta nets where
``--linear-attention-freq`` does, multi-latent or sparse attention, the MTP block, each
heterogeneous block's attention and MLP; for a hybrid
model, the kind of layer ``--hybrid-layer-pattern`` names at each index). Every rank
checks its own layers; the ranks share what they found, so that all stop with the same line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# TransformerConfig field -> the flag that sets it
CONFIG_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels", "num_moe_experts": "--num-experts", "moe_layer_freq": "--moe-layer-freq",
    "moe_router_topk": "--moe-router-topk",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "multi_latent_attention": "--multi-latent-attention", "mtp_num_layers": "--mtp-num-layers",
    "experimental_attention_variant": "--experimental-attention-variant",
    "linear_attention_freq": "--linear-attention-freq", "normalization": "--normalization",
    "layernorm_zero_centered_gamma": "--apply-layernorm-1p", "qk_layernorm": "--qk-layernorm",
    "gated_linear_unit": "--swiglu", "add_bias_linear": "--disable-bias-linear",
    "transformer_impl": "--transformer-impl",
}
TE_EXTENSIONS = "megatron.core.extensions.transformer_engine"  # Megatron's modules around TE's
MARKER = "ModelMismatchError"


class ModelMismatchError(Exception):
    """The built model is not the one the flags ask for; the message is one line."""


def layer_lines(chunks: Sequence[Any]) -> dict[int, str]:
    """Global layer index -> ``attention + MLP`` module classes, for this rank's layers."""
    lines = {}
    for chunk in chunks:
        for i, layer in enumerate(_layers(chunk)):
            lines[getattr(layer, "layer_number", i + 1) - 1] = _describe(layer)
        if getattr(chunk, "mtp", None) is not None:
            lines[-1] = f"{type(chunk.mtp).__name__} ({len(chunk.mtp.layers)} layer(s))"
    return lines


def summary(lines: dict[int, str]) -> str:
    """One line for a whole model: ``layers 0-1: SelfAttention + MLP; mtp: ...``, runs merged."""
    parts: list[str] = []
    numbered = sorted(i for i in lines if i >= 0)
    start = 0
    while start < len(numbered):
        end = start
        while end + 1 < len(numbered) and lines[numbered[end + 1]] == lines[numbered[start]]:
            end += 1
        first, last = numbered[start], numbered[end]
        span = f"layer {first}" if first == last else f"layers {first}-{last}"
        parts.append(f"{span}: {lines[first]}")
        start = end + 1
    if -1 in lines:
        parts.append(f"mtp: {lines[-1]}")
    return "; ".join(parts) or "no layers recorded"


def mismatches(chunks: Sequence[Any], args: Any) -> list[str]:
    """What of the flags ``args`` this rank's built model chunks do not have, one line each."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    expected = core_transformer_config_from_args(args)
    pattern = _hybrid_pattern(args)
    found: list[str] = []
    for chunk in chunks:
        found += _config_mismatches(expected, chunk.config)
        if getattr(chunk, "position_embedding_type", args.position_embedding_type) != args.position_embedding_type:
            found.append(f"--position-embedding-type asks for {args.position_embedding_type}, but the built "
                         f"model's is {chunk.position_embedding_type}")
        for layer in _layers(chunk):
            found += _layer_mismatches(layer, expected, pattern)
        found += _mtp_mismatches(chunk, expected)
    return found


def _config_mismatches(expected: Any, built: Any) -> list[str]:
    found = []
    for name, flag in CONFIG_FLAGS.items():
        want, have = getattr(expected, name, None), getattr(built, name, None)
        if want != have:
            found.append(f"{flag} asks for {name} = {want!r}, but the built model's config has {have!r}")
    return found


def _layers(chunk: Any) -> list[Any]:
    decoder = getattr(chunk, "decoder", None)
    return list(getattr(decoder, "layers", []))


def _is_transformer_layer(layer: Any) -> bool:
    return all(hasattr(layer, name) for name in ("layer_number", "self_attention", "mlp"))


def _describe(layer: Any) -> str:
    if not _is_transformer_layer(layer):  # a hybrid model's Mamba layer, say: its class
        return type(layer).__name__ + (" on TE" if _on_transformer_engine(layer) else "")
    attention = getattr(layer, "self_attention", None)
    mlp = getattr(layer, "mlp", None)
    # a hybrid model's attention and MLP layers hold an IdentityOp in the other place: left out
    text = " + ".join(type(module).__name__ for module in (attention, mlp) if type(module).__name__ != "IdentityOp")
    core = getattr(attention, "core_attention", None)
    if core is not None and type(core).__name__ == "DSAttention":
        text = text.replace(type(attention).__name__, f"{type(attention).__name__}(DSAttention)", 1)
    if hasattr(mlp, "experts") and hasattr(mlp, "router"):
        text += f" ({mlp.config.num_moe_experts} experts)"
    if _on_transformer_engine(layer):
        text += " on TE"
    return text


def _on_transformer_engine(layer: Any) -> bool:
    """Whether ``layer`` holds Megatron's Transformer Engine modules (``extensions/transformer_engine.py``)."""
    modules = getattr(layer, "modules", None)  # a torch module's submodules, itself included
    return modules is not None and any(type(module).__module__ == TE_EXTENSIONS for module in modules())


def _layer_mismatches(layer: Any, config: Any, pattern: tuple[str, str] | None = None) -> list[str]:
    """What ``layer`` lacks of the flags; ``pattern``: the hybrid pattern's flag and its layers."""
    index = layer.layer_number - 1
    found = []
    if getattr(config, "transformer_impl", None) == "transformer_engine" and not _on_transformer_engine(layer):
        found.append(f"--transformer-impl transformer_engine asks for Transformer Engine's layers, but the built "
                     f"model's layer {index} holds none")
    if pattern is not None:
        return found + _pattern_mismatches(layer, index, *pattern)
    if not _is_transformer_layer(layer):
        return found
    heterogeneous = getattr(config, "per_block_parameters", None) is not None
    blocks = _heterogeneous_wants(config, index) if heterogeneous else []
    for flag, wants, what, ok in blocks + _attention_wants(config, index) + _mlp_wants(config, index):
        module = layer.mlp if what == "MLP" else layer.self_attention
        if not ok(module):
            found.append(f"{flag} asks for {wants}, but the built model's {what} is "
                         f"{type(module).__name__} (layer {index})")
    return found


def _hybrid_pattern(args: Any) -> tuple[str, str] | None:
    """The hybrid pattern's flag and its decoder layers' symbols (pipeline stages and MTP cut off),
    None for a model without one."""
    if getattr(args, "hybrid_layer_pattern", None) is None:
        return None
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

    flag = "--hybrid-override-pattern" if args.hybrid_override_pattern else "--hybrid-layer-pattern"
    return flag, (parse_hybrid_pattern(args.hybrid_layer_pattern).main_pattern or "").replace(Symbols.PIPE, "")


def hybrid_layer_kinds() -> dict[str, tuple[str, Callable[[Any], bool]]]:
    """megatron-core's hybrid pattern symbols -> the layer each asks for, and its test."""
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    def attention(layer: Any) -> Any:
        return getattr(layer, "self_attention", None)

    def mlp(layer: Any) -> Any:
        return getattr(layer, "mlp", None)

    return {
        Symbols.MAMBA: ("a Mamba layer", lambda layer: isinstance(layer, MambaLayer)),
        Symbols.GDN: ("a gated delta net", lambda layer: isinstance(attention(layer), GatedDeltaNet)),
        Symbols.ATTENTION: ("self-attention", lambda layer: isinstance(attention(layer), SelfAttention)),
        Symbols.DS_ATTENTION: ("DeepSeek sparse attention", lambda layer: type(
            getattr(attention(layer), "core_attention", None)).__name__ == "DSAttention"),
        Symbols.MLA: ("multi-latent attention", lambda layer: isinstance(attention(layer), MultiLatentAttention)),
        Symbols.MLP: ("a dense MLP", lambda layer: isinstance(mlp(layer), MLP)),
        Symbols.MOE: ("experts", lambda layer: isinstance(mlp(layer), MoELayer)),
    }


def _pattern_mismatches(layer: Any, index: int, flag: str, symbols: str) -> list[str]:
    if index >= len(symbols):
        return [f"{flag} asks for {len(symbols)} layers, but the built model has a layer {index}"]
    what, holds = hybrid_layer_kinds()[symbols[index]]
    if holds(layer):
        return []
    return [f"{flag} asks for {what} at layer {index} ({symbols[index]!r}), but the built model's layer "
            f"{index} is {_describe(layer)}"]


Want = tuple[str, str, str, Callable[[Any], bool]]


HETEROGENEOUS = "--heterogeneous-layers-config-path"


def _block_wants(block: Any, what: str, full: str, full_holds: Callable[[Any], bool]) -> Want:
    """What a heterogeneous layers config's block asks of its attention or MLP: none, a linear
    layer in its place, or the full module (``full``, tested by ``full_holds``)."""
    if block.no_op:
        return HETEROGENEOUS, f"no {what} at this layer (its block's no_op)", what, lambda m: type(m).__name__ == "IdentityOp"
    if block.replace_with_linear:
        return (HETEROGENEOUS, f"a linear layer in place of the {what} (its block's replace_with_linear)", what,
                lambda m: type(m).__name__.endswith("ColumnParallelLinearGathered"))
    return HETEROGENEOUS, full, what, full_holds


def _heterogeneous_wants(config: Any, index: int) -> list[Want]:
    """Each heterogeneous block's attention and MLP, with its query groups and FFN size."""
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.mlp import MLP

    block = config.per_block_parameters[index]
    groups, ffn = block.attention.num_query_groups, block.mlp.ffn_hidden_size
    return [
        _block_wants(block.attention, "attention", f"attention with {groups or config.num_query_groups} query groups",
                     lambda m: isinstance(m, Attention) and m.config.num_query_groups == (groups or config.num_query_groups)),
        _block_wants(block.mlp, "MLP", f"an MLP of FFN size {ffn or config.ffn_hidden_size}",
                     lambda m: isinstance(m, MLP) and m.config.ffn_hidden_size == (ffn or config.ffn_hidden_size)),
    ]


def _attention_wants(config: Any, index: int) -> list[Want]:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    variant = config.experimental_attention_variant
    if variant == "gated_delta_net":
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_linear_attention_pattern,
        )

        if get_linear_attention_pattern(config)[index]:
            return [("--experimental-attention-variant gated_delta_net", "a gated delta net at this layer "
                     "(--linear-attention-freq)", "attention", lambda m: isinstance(m, GatedDeltaNet))]
    wants: list[Want] = []
    if config.multi_latent_attention:  # DSA's attention is the absorbed form of MLA, another class
        wants.append(("--multi-latent-attention", "multi-latent attention", "attention",
                      lambda m: isinstance(m, MultiLatentAttention) or type(m).__name__ == "AbsorbedMLASelfAttention"))
    if variant == "dsa":
        wants.append(("--experimental-attention-variant dsa", "DeepSeek sparse attention", "attention",
                      lambda m: type(getattr(m, "core_attention", None)).__name__ == "DSAttention"))
    return wants


def _mlp_wants(config: Any, index: int) -> list[Want]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if not config.num_moe_experts:
        return [("--num-experts (not given)", "a dense MLP", "MLP", lambda m: not isinstance(m, MoELayer))]
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_moe_layer_pattern,
    )

    if get_moe_layer_pattern(config)[index]:
        return [("--num-experts", f"{config.num_moe_experts} experts at this layer (--moe-layer-freq)", "MLP",
                 lambda m: isinstance(m, MoELayer))]
    return [("--moe-layer-freq", "a dense MLP at this layer", "MLP", lambda m: not isinstance(m, MoELayer))]


def _mtp_mismatches(chunk: Any, config: Any) -> list[str]:
    if not config.mtp_num_layers or not hasattr(chunk, "decoder"):
        return []
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    if not mtp_on_this_rank(config.pipeline_model_parallel_layout, config.mtp_num_layers, ignore_virtual=False,
                            vp_stage=getattr(chunk, "vp_stage", None)):
        return []
    if getattr(chunk, "mtp", None) is None:
        return [f"--mtp-num-layers {config.mtp_num_layers} asks for a multi-token prediction block, but the "
                "built model has none"]
    return []


def check_built_model(model: Sequence[Any]) -> dict[int, str]:
    """Raise :class:`ModelMismatchError` (on every rank alike) when the model misses a flag;
    return this rank's layer lines."""
    import torch.distributed as dist
    from megatron.core.utils import unwrap_model
    from megatron.training import get_args

    chunks = unwrap_model(list(model))
    found = mismatches(chunks, get_args())
    if dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        found = [line for lines in everyone for line in lines]
    if found:
        raise ModelMismatchError(found[0])
    return layer_lines(chunks)
