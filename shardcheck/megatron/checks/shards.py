"""Where each local parameter sits in its global tensor, read from Megatron's ``sharded_state_dict``.

Megatron describes every parameter's global tensor (key, global shape, offset, prepended layer
axes; GLU ``fc1`` through a factory that splits it in two). The checker types parameters from
it (:func:`shardcheck.megatron.checks.typing.tp_layouts`), and the scenarios load and gather
global tensors with it (:mod:`shardcheck.megatron.scenarios.reference`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

Builder = Callable[[torch.Tensor], list[ShardedTensor]]


@dataclass(frozen=True)
class ParamShards:
    """One parameter and how to cut any tensor of its shape into its global pieces."""

    name: str
    param: torch.nn.Parameter
    build: Builder


def _leaves(tree) -> Iterator:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(tree=value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree


def _builder(leaf) -> Builder | None:
    if isinstance(leaf, ShardedTensorFactory):
        return lambda t: list(_leaves(leaf.build_fn(leaf.key, t, leaf.replica_id, None)))
    if isinstance(leaf, ShardedTensor) and leaf.flattened_range is None:
        return lambda t: [replace(leaf, data=t, dtype=t.dtype)]  # an fp32 main_grad of a 16-bit param
    return None


def param_shards(model: torch.nn.Module) -> list[ParamShards]:
    """Every parameter of ``model`` with its sharded-state-dict builder, in parameter order."""
    by_storage = {(p.data_ptr(), tuple(p.shape)): (n, p) for n, p in model.named_parameters()}
    found: dict[str, ParamShards] = {}
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    for leaf in _leaves(model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))):
        data = getattr(leaf, "data", None)
        build = _builder(leaf)
        if data is None or build is None:
            continue
        hit = by_storage.get((data.data_ptr(), tuple(data.shape)))
        if hit is not None:
            found.setdefault(hit[0], ParamShards(hit[0], hit[1], build))
    missing = [n for n, _ in model.named_parameters() if n not in found]
    if missing:
        raise ValueError(f"parameters without sharded_state_dict metadata: {missing}")
    return [found[n] for n, _ in model.named_parameters()]
