"""The catalogue of Megatron scenarios: each component is ``scenario(ctx) -> dict[str, Tensor]``.

``scenario("gpt", loss_mask=True, config={"calculate_per_token_loss": True})`` gives a
picklable scenario for one component and its options; :data:`COMPONENTS` lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from shardcheck.megatron.scenarios.gpt import GPTSetup, train_step
from shardcheck.megatron.scenarios.moe_router import RouterSetup, router_step
from shardcheck.megatron.scenarios.output_loss import OutputLossSetup, output_loss


@dataclass(frozen=True)
class Component:
    """A Megatron component: how to run it under a layout, and its options' dataclass."""

    run: Callable[[Any, Any], dict]
    setup: type


COMPONENTS: dict[str, Component] = {
    "gpt": Component(train_step, GPTSetup),
    "output_loss": Component(output_loss, OutputLossSetup),
    "moe_router": Component(router_step, RouterSetup),
}


def scenario(component: str, **options: Any) -> Callable[[Any], dict]:
    """The scenario ``ctx -> outputs`` of ``component`` with ``options`` (its setup fields)."""
    if component not in COMPONENTS:
        raise KeyError(f"unknown Megatron component {component!r}; known: {sorted(COMPONENTS)}")
    entry = COMPONENTS[component]
    return partial(entry.run, setup=entry.setup(**options))
