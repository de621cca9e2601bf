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
    """Every parameter of ``model`` with its sharded-state-dict builder, in parameter order.
    A parameter whose state dict holds it as row blocks under keys of their own (the fused
    MLA down projection: the query's and the key-value's) is built from its blocks."""
    named = list(model.named_parameters())
    by_storage = {(p.data_ptr(), tuple(p.shape)): (n, p) for n, p in named}
    found: dict[str, ParamShards] = {}
    blocks: dict[str, list[tuple[int, int, Builder]]] = {}
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    for leaf in _leaves(model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))):
        data = getattr(leaf, "data", None)
        build = _builder(leaf)
        if data is None or build is None:
            continue
        hit = by_storage.get((data.data_ptr(), tuple(data.shape)))
        if hit is not None:
            found.setdefault(hit[0], ParamShards(hit[0], hit[1], build))
        elif (owner := _rows_of(named, data)) is not None:
            blocks.setdefault(owner[0], []).append((owner[1], data.shape[0], build))
    for name, param in named:
        if name not in found and name in blocks and _covers(blocks[name], param.shape[0]):
            found[name] = ParamShards(name, param, _from_blocks(sorted(blocks[name], key=lambda b: b[0])))
    missing = [n for n, _ in named if n not in found]
    if missing:
        raise ValueError(f"parameters without sharded_state_dict metadata: {missing}")
    return [found[n] for n, _ in model.named_parameters()]


def _rows_of(named: list[tuple[str, torch.nn.Parameter]], data: torch.Tensor) -> tuple[str, int] | None:
    """``(parameter name, first row)`` of the parameter that ``data`` is a block of whole rows
    of (a view of its storage, its trailing shape), else None."""
    for name, param in named:
        if (param.dim() > 0 and data.dim() == param.dim() and data.shape[1:] == param.shape[1:]
                and data.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
                and data.stride() == param.stride()):
            offset = data.storage_offset() - param.storage_offset()
            row, rest = divmod(offset, param.stride(0))
            if not rest and 0 <= row and row + data.shape[0] <= param.shape[0]:
                return name, row
    return None


def _covers(blocks: list[tuple[int, int, Builder]], rows: int) -> bool:
    """Whether the row blocks tile ``rows`` rows exactly, one after the other."""
    end = 0
    for start, length, _ in sorted(blocks, key=lambda b: b[0]):
        if start != end:
            return False
        end += length
    return end == rows


def _from_blocks(blocks: list[tuple[int, int, Builder]]) -> Builder:
    """A builder that cuts a tensor of the parameter's shape into its row blocks' pieces."""
    return lambda t: [piece for start, length, build in blocks for piece in build(t[start:start + length])]
