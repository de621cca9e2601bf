"""``t.data = other`` (no op reaches the dispatch mode) gives ``t`` the type of its new data, on
real Gloo ranks: Megatron's distributed saved activations keep each tp rank's flat chunk of a
replicated activation and gather it back (right), against gathering the full tensor (wrong)."""

import pytest
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

NUMEL = 8


def _global() -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32).reshape(2, NUMEL // 2)


def saved_and_restored(keep_chunk: bool) -> torch.Tensor:
    """Swap the activation's data for this rank's flat chunk (or a full copy), then gather."""
    n, r = dist.get_world_size(), dist.get_rank()
    saved = sc.annotate(_global(), tp=sc.R)
    flat = saved.view(-1)
    size = flat.numel() // n
    chunk = torch.empty(size if keep_chunk else flat.numel())
    chunk.copy_(flat[r * size:(r + 1) * size] if keep_chunk else flat)
    saved.data = chunk
    gathered = torch.empty(saved.numel() * n)
    dist.all_gather_into_tensor(gathered, saved.data)
    return gathered[:NUMEL].view(2, NUMEL // 2)


def _run(keep_chunk: bool) -> dict:
    with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):
        value = saved_and_restored(keep_chunk)
        types = {axis: repr(p) for axis, p in sc.typeof(value).items()}
    return {"value": value.tolist(), "types": types, "rules": [v.rule for v in sc.violations()]}


def _ranks() -> dict:
    return {keep: _run(keep) for keep in (True, False)} | {"data_restored": "data" not in torch.Tensor.__dict__}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_ranks, 2)


def test_a_rank_chunk_swapped_in_and_gathered_back_is_the_replicated_activation(ranks):
    for rank in ranks:
        assert (rank[True]["types"], rank[True]["rules"]) == ({"tp": "R"}, [])
        assert rank[True]["value"] == _global().tolist()


def test_gathering_a_full_copy_swapped_in_is_still_flagged(ranks):
    for rank in ranks:
        assert rank[False]["rules"] == ["gather of replicated"]


def test_the_tensor_data_property_is_torchs_own_outside_the_checker(ranks):
    assert all(rank["data_restored"] for rank in ranks)
