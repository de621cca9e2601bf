"""Megatron's ``parallel_state`` for a scenario's layout, set up on Gloo and torn down after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from shardcheck.megatron.cpu import apply_cpu_patches

DEFAULT_ORDER = "tp-cp-ep-dp-pp"


class LayoutUnsupported(ValueError):
    """A layout Megatron's global ``parallel_state`` cannot express on this process group."""


def _check(layout: Any) -> None:
    world = layout.tp * layout.cp * layout.dp * layout.pp
    if dist.get_world_size() != world:
        raise LayoutUnsupported(
            f"layout needs {world} ranks but the default process group has {dist.get_world_size()}")
    if getattr(layout, "explicit_groups", None):
        raise LayoutUnsupported("explicit_groups are not expressible in Megatron's parallel_state")
    if layout.sp and layout.tp == 1:
        raise LayoutUnsupported("sequence parallelism needs tp > 1")


@contextmanager
def megatron_parallel(ctx: Any, seed: int = 1234) -> Iterator[None]:
    """Initialise Megatron's model-parallel groups and RNG for ``ctx.layout``; destroy them after.

    ``ctx`` needs ``.layout`` with ``tp, cp, dp, ep, pp, sp`` (and optionally ``order``).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    apply_cpu_patches()
    layout = ctx.layout
    _check(layout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        order=getattr(layout, "order", DEFAULT_ORDER),
    )
    try:
        model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        parallel_state.destroy_model_parallel()
