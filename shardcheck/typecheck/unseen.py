"""Tensors made where the dispatch mode sees no op, typed while ``typecheck`` is active.

- ``t.data = value``: ``t`` now holds ``value``'s data, and so its type (Megatron swaps a
  replicated activation for its rank's chunk this way).
- ``torch.get_rng_state()``: the generator's state, V on every axis (ranks may seed apart).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardcheck.typecheck import tensor_state

_TENSOR_DATA = torch._C.TensorBase.__dict__["data"]
_GET_RNG_STATE = torch.random.get_rng_state


_DATA_SWAPPED: list[Callable[[], None]] = []


def _data_with_its_type(t: torch.Tensor, value: torch.Tensor) -> None:
    _TENSOR_DATA.__set__(t, value)
    tensor_state.write(t, "type", tensor_state.type_of(value))
    for swapped in _DATA_SWAPPED:
        swapped()


def install(varying: Callable[[torch.Tensor], torch.Tensor], data_swapped: Callable[[], None]) -> None:
    """Type the tensors above; ``varying(t)`` types ``t`` V on every axis of the innermost
    checker, ``data_swapped()`` is told of each ``t.data = value``."""
    _DATA_SWAPPED[:] = [data_swapped]
    torch.Tensor.data = property(_TENSOR_DATA.__get__, _data_with_its_type)

    def rng_state() -> torch.Tensor:
        return varying(_GET_RNG_STATE())

    torch.get_rng_state = torch.random.get_rng_state = rng_state


def uninstall() -> None:
    del torch.Tensor.data
    torch.get_rng_state = torch.random.get_rng_state = _GET_RNG_STATE
