"""The catalogue of Megatron scenarios: each component is ``scenario(ctx) -> dict[str, Tensor]``.

``scenario("gpt", loss_mask=True, config={"calculate_per_token_loss": True})`` gives a
picklable scenario for one component and its options; :data:`COMPONENTS` lists them and
:data:`PRESETS` names a starting set of (component, options) that a sweep varies further with
:func:`shardcheck.megatron.fields.config_choices`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from shardcheck.megatron.scenarios.gpt import GPTSetup, train_step
from shardcheck.megatron.scenarios.moe_router import RouterSetup, router_step
from shardcheck.megatron.scenarios.output_loss import OutputLossSetup, output_loss
from shardcheck.megatron.scenarios.ssm import GDNSetup, MambaSetup, gdn_step, mamba_step


@dataclass(frozen=True)
class Component:
    """A Megatron component: how to run it under a layout, and its options' dataclass."""

    run: Callable[[Any, Any], dict]
    setup: type


COMPONENTS: dict[str, Component] = {
    "gpt": Component(train_step, GPTSetup),
    "output_loss": Component(output_loss, OutputLossSetup),
    "moe_router": Component(router_step, RouterSetup),
    "gdn": Component(gdn_step, GDNSetup),
    "mamba": Component(mamba_step, MambaSetup),
}


def scenario(component: str, **options: Any) -> Callable[[Any], dict]:
    """The scenario ``ctx -> outputs`` of ``component`` with ``options`` (its setup fields)."""
    if component not in COMPONENTS:
        raise KeyError(f"unknown Megatron component {component!r}; known: {sorted(COMPONENTS)}")
    entry = COMPONENTS[component]
    return partial(entry.run, setup=entry.setup(**options))


_MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
        "add_bias_linear": False}

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
    "moe/alltoall": ("gpt", {"config": {**_MOE, "moe_token_dispatcher_type": "alltoall"}}),
    "moe/allgather": ("gpt", {"config": {**_MOE, "moe_token_dispatcher_type": "allgather"}}),
    "loss/plain": ("output_loss", {}),
    "loss/label-smoothing": ("output_loss", {"label_smoothing": 0.1}),
    "loss/gathered-output": ("output_loss", {"parallel_output": False}),
    "loss/runtime-gather": ("output_loss", {"runtime_gather_output": True}),
    "router/plain": ("moe_router", {}),
    "router/padding": ("moe_router", {"padding": True}),
    "router/per-token-loss": ("moe_router", {"config": {"calculate_per_token_loss": True}}),
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
