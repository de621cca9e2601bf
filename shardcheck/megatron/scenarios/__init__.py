"""The catalogue of Megatron scenarios: each component is ``scenario(ctx) -> dict[str, Tensor]``.

``scenario("gpt", loss_mask=True, config={"calculate_per_token_loss": True})`` gives a
picklable scenario for one component and its options; :data:`COMPONENTS` lists them and
:data:`PRESETS` names a starting set of (component, options) that a sweep varies further with
:func:`shardcheck.megatron.audit.fields.config_choices`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib.util import find_spec
from typing import Any

from shardcheck.megatron.cpu.parallel import LayoutUnsupported
from shardcheck.megatron.scenarios import mla, multimodal, ssm, t5
from shardcheck.megatron.scenarios.gpt import GPTSetup, MoEGPTSetup, MTPGPTSetup, train_step
from shardcheck.megatron.scenarios.hybrid import HybridSetup, hybrid_step
from shardcheck.megatron.scenarios.mla import MLASetup, mla_step
from shardcheck.megatron.scenarios.moe_router import RouterSetup, router_step
from shardcheck.megatron.scenarios.multimodal import MultimodalSetup, multimodal_step
from shardcheck.megatron.scenarios.output_loss import OutputLossSetup, output_loss
from shardcheck.megatron.scenarios.ssm import GDNSetup, MambaSetup, gdn_step, mamba_step
from shardcheck.megatron.scenarios.t5 import T5Setup, t5_step


@dataclass(frozen=True)
class Component:
    """A Megatron component: how to run it under a layout, and its options' dataclass.

    ``experts``: it has MoE experts, so expert-parallel layouts apply. ``config_prefix``: the
    sweep varies only the TransformerConfig fields with this prefix (the MoE GPT leaves the
    fields it shares with the plain GPT to the ``gpt`` component; the MTP GPT varies its own
    ``mtp_`` fields, the per-token loss and muP, whose MTP scaling is its own code).
    ``config_code``: megatron-core modules or packages that are the component's own code; the
    sweep also varies every TransformerConfig field they read (``config.NAME``), whatever its
    prefix: a general option that changes the component's own path (the per-token loss in the
    router's auxiliary-loss scaling) is swept with the component.
    ``check_layout``: raises ``LayoutUnsupported`` for the layouts the component's own
    scenario refuses.
    ``explicit_groups``: it passes the explicit ``ProcessGroupCollection`` that
    ``megatron_parallel`` yields to Megatron, so it runs under layouts with explicit groups.
    ``model``: ``module:Class`` of the Megatron model it builds, whose own constructor and
    forward arguments its setup's ``model_args`` and ``forward_args`` pass on.
    ``default_layouts``: the default audit plan runs only the component's defaults, at these
    layouts (and its Transformer Engine tier), and leaves the rest of its plan to ``--full``;
    None: the default plan's whole selection.
    """

    run: Callable[[Any, Any], dict]
    setup: type
    experts: bool = False
    config_prefix: str | tuple[str, ...] = ""
    config_code: tuple[str, ...] = ()
    check_layout: Callable[[Any], None] | None = None
    explicit_groups: bool = False
    model: str = ""
    default_layouts: tuple[str, ...] | None = None

    def refuses(self, layout: Any) -> str | None:
        """Why the component cannot run under ``layout`` (checked before any rank starts)."""
        if (layout.ep > 1 or getattr(layout, "etp", None) is not None) and not self.experts:
            return "expert parallelism needs a component with experts"
        if self.experts and layout.tp > 1 and not layout.sp:
            return "MoE with tp > 1 needs sequence parallelism (Megatron refuses it)"
        try:
            if self.check_layout is not None:
                self.check_layout(layout)
        except LayoutUnsupported as why:
            return str(why)
        return None


# MLA's default-plan slice: its defaults under tensor parallelism with and without sp (and its
# fused down projection at tp2-sp, sweep.te_option_sets); its options and other layouts: --full
MLA_DEFAULT_LAYOUTS = ("tp2", "tp2-sp")
GPT_MODEL = "megatron.core.models.gpt.gpt_model:GPTModel"
HYBRID_MODEL = "megatron.core.models.hybrid.hybrid_model:HybridModel"
COMPONENTS: dict[str, Component] = {
    "gpt": Component(train_step, GPTSetup, explicit_groups=True, model=GPT_MODEL),
    "output_loss": Component(output_loss, OutputLossSetup, explicit_groups=True),
    "moe": Component(train_step, MoEGPTSetup, experts=True, config_prefix="moe_",
                     config_code=("megatron.core.transformer.moe",), explicit_groups=True),
    "mtp": Component(train_step, MTPGPTSetup, config_prefix=("mtp_", "calculate_per_token_loss", "use_mup"),
                     explicit_groups=True),
    "moe_router": Component(router_step, RouterSetup, experts=True, explicit_groups=True,
                            model="megatron.core.transformer.moe.router:TopKRouter"),
    "t5": Component(t5_step, T5Setup, check_layout=t5.check_layout, explicit_groups=True,
                    model="megatron.core.models.T5.t5_model:T5Model"),
    "multimodal": Component(multimodal_step, MultimodalSetup, check_layout=multimodal.check_layout,
                            explicit_groups=True,
                            model="megatron.core.models.multimodal.llava_model:LLaVAModel"),
    # its own MLATransformerConfig fields and those MLA's code reads; GPTModel's arguments left to gpt
    "mla": Component(mla_step, MLASetup, config_prefix="mla_",
                     config_code=("megatron.core.transformer.multi_latent_attention",),
                     check_layout=mla.check_layout, explicit_groups=True,
                     default_layouts=MLA_DEFAULT_LAYOUTS),
    "gdn": Component(gdn_step, GDNSetup, explicit_groups=True),
    "mamba": Component(mamba_step, MambaSetup, check_layout=ssm.check_mamba_layout,
                       explicit_groups=True),
}
if find_spec("megatron.core.models.hybrid") is not None:  # megatron-core 0.19 on; 0.16 has none
    # Transformer Engine only (HybridSetup.impl); its own Mamba and GDN config fields, MoE's left to moe
    COMPONENTS["hybrid"] = Component(hybrid_step, HybridSetup, config_prefix=("mamba_", "linear_"),
                                     explicit_groups=True, model=HYBRID_MODEL)


def scenario(component: str, **options: Any) -> Callable[[Any], dict]:
    """The scenario ``ctx -> outputs`` of ``component`` with ``options`` (its setup fields)."""
    if component not in COMPONENTS:
        raise KeyError(f"unknown Megatron component {component!r}; known: {sorted(COMPONENTS)}")
    entry = COMPONENTS[component]
    return partial(entry.run, setup=entry.setup(**options))


PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt/plain": ("gpt", {}),
    "gpt/loss-mask": ("gpt", {"loss_mask": True}),
    "gpt/per-token-loss": ("gpt", {"loss_mask": True, "config": {"calculate_per_token_loss": True}}),
    "gpt/tied-embeddings": ("gpt", {"share_embeddings": True}),
    "attention/gqa": ("gpt", {"config": {"num_query_groups": 2}}),
    "attention/qk-layernorm": ("gpt", {"config": {"qk_layernorm": True}}),
    "attention/rope": ("gpt", {"position_embedding": "rope"}),
    "attention/learnable-softmax": ("gpt", {"config": {"softmax_type": "learnable"}}),
    "mlp/glu": ("gpt", {"config": {"gated_linear_unit": True}}),
    "norm/rmsnorm": ("gpt", {"config": {"normalization": "RMSNorm"}}),
    "moe/alltoall": ("moe", {"config": {"moe_token_dispatcher_type": "alltoall"}}),
    "moe/allgather": ("moe", {"config": {"moe_token_dispatcher_type": "allgather"}}),
    "loss/plain": ("output_loss", {}),
    "loss/label-smoothing": ("output_loss", {"label_smoothing": 0.1}),
    "loss/gathered-output": ("output_loss", {"parallel_output": False}),
    "loss/runtime-gather": ("output_loss", {"runtime_gather_output": True}),
    "mtp/plain": ("mtp", {}),
    "mtp/per-token-loss": ("mtp", {"loss_mask": True, "config": {"calculate_per_token_loss": True}}),
    "router/plain": ("moe_router", {}),
    "router/padding": ("moe_router", {"padding": True}),
    "router/per-token-loss": ("moe_router", {"config": {"calculate_per_token_loss": True}}),
    "t5/cross-attention": ("t5", {}),
    "t5/encoder-padding": ("t5", {"encoder_padding": True, "loss_mask": True}),
    "t5/rope-tied": ("t5", {"position_embedding": "rope", "share_embeddings": True}),
    "multimodal/llava": ("multimodal", {}),
    "multimodal/text-only-sample": ("multimodal", {"text_only_sample": True, "loss_mask": True}),
    "multimodal/class-token": ("multimodal", {"keep_class_token": True}),
    "ssm/gdn": ("gdn", {}),
    "ssm/gdn-conv-bias": ("gdn", {"conv_bias": True, "bias": True}),
    "ssm/mamba": ("mamba", {}),
    "ssm/mamba-unfused-scan": ("mamba", {"config": {"use_mamba_mem_eff_path": False}}),
}


def preset(name: str) -> Callable[[Any], dict]:
    """The scenario of a named preset (see :data:`PRESETS`)."""
    if name not in PRESETS:
        raise KeyError(f"unknown Megatron preset {name!r}; known: {sorted(PRESETS)}")
    component, options = PRESETS[name]
    return scenario(component, **options)
