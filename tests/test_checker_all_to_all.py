"""Megatron's sequence <-> hidden all-to-alls on real Gloo ranks: both directions and their
gradients typed as the shards they make, checked against the one-rank numbers."""

import pytest
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

pytest.importorskip("megatron.core")


def _values() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(8, 6, generator=gen, dtype=torch.float64),
            torch.randn(8, 6, generator=gen, dtype=torch.float64))


def _round_trip(reverse: bool) -> tuple[dict[str, str], list[str], torch.Tensor, torch.Tensor]:
    """x (rows cut over tp) to the hidden shard and back, times w; ``reverse`` joins the
    exchanged blocks in the wrong order (the rows then line up with nothing)."""
    from megatron.core.tensor_parallel.mappings import all_to_all, all_to_all_sp2hp

    group, rank = dist.new_group([0, 1]), dist.get_rank()
    full, weight = _values()
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        x = sc.annotate(full.chunk(2, 0)[rank].clone().requires_grad_(), tp=sc.S(0))
        w = sc.annotate(weight.chunk(2, 1)[rank].clone(), tp=sc.S(1))
        hidden = all_to_all_sp2hp(x, group) * w
        blocks = all_to_all(group, hidden).split(4, dim=0)
        rows = torch.cat(blocks[::-1] if reverse else blocks, dim=-1)
        (rows * rows).sum().backward()
        types = {"sp2hp": sc.typeof(hidden)["tp"], "hp2sp": sc.typeof(rows).get("tp"),
                 "x.grad": sc.typeof(x.grad).get("tp")}
        found = [v.rule for v in sc.violations()]
    return {k: repr(v) for k, v in types.items()}, found, rows.detach().clone(), x.grad.detach().clone()


def _one_rank() -> tuple[torch.Tensor, torch.Tensor]:
    """The rows and the gradient of x on one rank."""
    full, weight = _values()
    full.requires_grad_()
    rows = full * weight
    (rows * rows).sum().backward()
    return rows.detach(), full.grad


def test_sp2hp_then_hp2sp_and_the_gradient_through_both_are_the_shards_they_make():
    ranks = spawn_ranks(_round_trip, 2, False)
    assert [r[:2] for r in ranks] == [({"sp2hp": "S(1)", "hp2sp": "S(0)", "x.grad": "S(0)"}, [])] * 2
    rows, grad = _one_rank()
    assert torch.allclose(torch.cat([r[2] for r in ranks]), rows)
    assert torch.allclose(torch.cat([r[3] for r in ranks]), grad)


def test_the_exchanged_blocks_joined_out_of_order_are_no_shard():
    ranks = spawn_ranks(_round_trip, 2, True)
    assert [r[0]["hp2sp"] for r in ranks] == ["V", "V"]
    assert not torch.allclose(torch.cat([r[2] for r in ranks]), _one_rank()[0])
