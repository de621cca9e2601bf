"""Gradient types on a 2048-rank layout (TP=8 x CP=4 x DP=64), one process, fake backend."""

import grad_programs as programs
import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD = 2048


@pytest.fixture(params=[0, 1234, WORLD - 1])
def fake_rank(request):
    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=WORLD)
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


def test_gradients_reduced_over_dp_and_cp(fake_rank):
    assert programs.fake_layout_step("dp_cp") == []


def test_gradients_reduced_over_dp_only_are_unreduced_on_cp(fake_rank):
    found = programs.fake_layout_step("dp")
    names = ["norm.weight", "norm.bias", "fc1.weight", "fc2.weight"]
    assert found == [("unreduced gradient", name, "cp") for name in names]
