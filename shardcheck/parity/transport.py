"""Pickling for results that cross processes, with plain tensors as raw bytes.

torch pickles a tensor's storage as a whole ``torch.save`` file and reads it back through
``torch.load``: milliseconds per tensor, and a case's results (every parameter's gradient,
the recorded activations) hold thousands of small ones. Here a plain CPU tensor travels as its
bytes, dtype, shape and Python attributes (Megatron's metadata, the checker's record) and comes
back as torch's pickling gives it back (equal, a leaf, ``requires_grad`` kept); anything else
(a ``Parameter`` or another subclass, a sparse, quantized or GPU tensor) pickles as torch
pickles it.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes


def dumps(value: Any) -> bytes:
    """``pickle.dumps(value)``, with plain tensors as raw bytes."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _REDUCERS
    with _disable_current_modes():  # a type checker on the rank would record the copies as views
        pickler.dump(value)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """The value :func:`dumps` pickled."""
    return pickle.loads(data)


def _reduce(tensor: torch.Tensor) -> tuple:
    if not _plain(tensor):
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    # the attributes as state, set after the tensor is memoised: they may refer back to it
    return _rebuild, (raw, tensor.dtype, tuple(tensor.shape), tensor.requires_grad), tensor.__dict__ or None, \
        None, None, _set_attributes


def _plain(tensor: torch.Tensor) -> bool:
    return tensor.layout == torch.strided and tensor.device.type == "cpu" and not tensor.is_quantized


def _rebuild(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool) -> torch.Tensor:
    if raw:
        tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    else:
        tensor = torch.empty(shape, dtype=dtype)
    return tensor.requires_grad_(requires_grad)


def _set_attributes(tensor: torch.Tensor, attributes: dict[str, Any]) -> None:
    tensor.__dict__.update(attributes)


_REDUCERS = {**copyreg.dispatch_table, torch.Tensor: _reduce}
