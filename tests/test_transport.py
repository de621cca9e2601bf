"""Results cross processes pickled by :mod:`shardcheck.parity.transport`: plain tensors as raw
bytes, everything else as torch pickles it, each coming back equal."""

import pickle

import pytest
import torch

from shardcheck.parity.transport import dumps, loads


def _tagged() -> torch.Tensor:
    tensor = torch.randn(3)
    tensor.tensor_model_parallel = True  # Megatron's metadata: kept by torch's own pickling
    return tensor


def _self_referring() -> torch.Tensor:
    tensor = torch.randn(2)
    tensor.root = [tensor]  # the checker's record may name the tensor it sits on
    return tensor


def _non_leaf() -> torch.Tensor:
    return torch.randn(2, requires_grad=True) * 2


CASES = {
    "float32": lambda: torch.randn(3, 4),
    "transposed": lambda: torch.randn(3, 4).t(),
    "scalar": lambda: torch.tensor(2.5),
    "empty": lambda: torch.empty(0, 3),
    "bfloat16": lambda: torch.randn(2, 5, dtype=torch.bfloat16),
    "bool": lambda: torch.tensor([True, False, True]),
    "int64": lambda: torch.arange(7),
    "conjugated complex": lambda: torch.randn(3, dtype=torch.complex64).conj(),
    "leaf requiring grad": lambda: torch.randn(4, requires_grad=True),
    "parameter": lambda: torch.nn.Parameter(torch.randn(2, 2)),
    "tagged": _tagged,
    "self-referring": _self_referring,
    "non-leaf requiring grad": _non_leaf,
    "sparse": lambda: torch.eye(3).to_sparse(),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_tensor_comes_back_as_pickle_gives_it(name):
    tensor = CASES[name]()
    mine, torchs = loads(dumps({"x": [tensor, (1, "a")]})), pickle.loads(pickle.dumps({"x": [tensor, (1, "a")]}))
    got, want = mine["x"][0], torchs["x"][0]
    assert mine["x"][1] == (1, "a")
    assert (type(got), got.dtype, got.shape, got.requires_grad, got.is_leaf, got.layout) == (
        type(want), want.dtype, want.shape, want.requires_grad, want.is_leaf, want.layout)
    assert torch.equal(got.detach().resolve_conj().to_dense(), tensor.detach().resolve_conj().to_dense())
    assert got.__dict__.keys() == tensor.__dict__.keys()
    assert "root" not in got.__dict__ or got.root[0] is got


def test_plain_tensors_travel_as_their_bytes_not_as_torch_save_files():
    tensors = [torch.randn(4, 4) for _ in range(50)]
    assert len(dumps(tensors)) < len(pickle.dumps(tensors)) / 2  # torch.save's archive per storage

