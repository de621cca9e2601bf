"""Backward kernels and losses typed by shardcheck.typecheck.rules.backward, on a fake 2-rank tp group.

An input sharded on its last dim goes through an op and back; its gradient must come out
sharded the same way, with every op call typed.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardcheck as sc


@pytest.fixture(scope="module")
def tp():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def target(x):
    return sc.annotate(torch.rand_like(x), tp=sc.S(2))


PROGRAMS = {
    "select": lambda x: (x[:, -1] * x[:, 0]).sum(),
    "slice": lambda x: x[:, 1:4].pow(2).sum(),
    "narrow": lambda x: x.narrow(1, 2, 2).exp().sum(),
    "index_select": lambda x: torch.index_select(x, 1, torch.tensor([0, 2])).pow(2).sum(),
    "mse_loss": lambda x: F.mse_loss(x, target(x), reduction="sum"),
    "l1_loss": lambda x: F.l1_loss(x, target(x), reduction="sum"),
    "smooth_l1_loss": lambda x: F.smooth_l1_loss(x, target(x), reduction="sum"),
    "bce_with_logits": lambda x: F.binary_cross_entropy_with_logits(x, target(x), reduction="sum"),
    "sdpa": lambda x: F.scaled_dot_product_attention(*[x.permute(2, 1, 0)] * 3).pow(2).sum(),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_gradient_keeps_the_input_layout(tp, name):
    with sc.typecheck(sc.Mesh(tp=tp)):
        x = sc.annotate(torch.randn(4, 6, 8, requires_grad=True), tp=sc.S(2))
        loss = PROGRAMS[name](x)
        loss.backward()
        assert sc.typeof(loss) == {"tp": sc.P}
        assert sc.typeof(x.grad) == {"tp": sc.S(2)}
        assert sc.coverage().unknown == 0


def test_mean_loss_over_a_shard_is_a_partial_average(tp):
    with sc.typecheck(sc.Mesh(tp=tp)):
        x = sc.annotate(torch.randn(4, 6, 8), tp=sc.S(2))
        assert repr(sc.typeof(F.mse_loss(x, target(x)))["tp"]) == "P(avg)"


@pytest.mark.parametrize("bias", [False, True])
def test_a_depthwise_convolution_over_tp_channels_keeps_them_sharded_forward_and_backward(tp, bias):
    """Megatron's GDN in deterministic mode convolves its tp-local channels with
    ``F.conv1d(groups=channels)``: channels S(1) with a weight S(0) give channels S(1), and
    the weight's gradient S(0) (each rank's own channels, summed over batch and positions)."""
    with sc.typecheck(sc.Mesh(tp=tp)):
        x = sc.annotate(torch.randn(2, 6, 8, requires_grad=True), tp=sc.S(1))
        weight = sc.annotate(torch.randn(6, 1, 4, requires_grad=True), tp=sc.S(0))
        b = sc.annotate(torch.randn(6, requires_grad=True), tp=sc.S(0)) if bias else None
        y = F.conv1d(x, weight, b, padding=3, groups=6)
        assert sc.typeof(y) == {"tp": sc.S(1)}
        y.pow(2).sum().backward()
        assert sc.typeof(x.grad) == {"tp": sc.S(1)} and sc.typeof(weight.grad) == {"tp": sc.S(0)}
        assert b is None or sc.typeof(b.grad) == {"tp": sc.S(0)}
        assert sc.coverage().unknown == 0


def test_a_plain_convolution_of_replicated_values_is_replicated_and_a_cut_sequence_unknown(tp):
    with sc.typecheck(sc.Mesh(tp=tp)):
        x = sc.annotate(torch.randn(2, 3, 8), tp=sc.R)
        weight = sc.annotate(torch.randn(5, 3, 2), tp=sc.R)
        assert sc.typeof(F.conv1d(x, weight)) == {"tp": sc.R}
        # each position reads its neighbours: a sequence cut over tp has no type
        cut = sc.annotate(torch.randn(2, 3, 8), tp=sc.S(2))
        assert sc.typeof(F.conv1d(cut, weight)) == {}
