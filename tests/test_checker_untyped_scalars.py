"""A scalar the checked region computed without a type (from data the checker cannot see
through, like activations received from another pipeline stage) may differ per rank: added
into replicated zeros and SUM all-reduced, it is a count of each rank's own (MTP's acceptance
counts at dp2-pp2), not a double count. A one-element tensor made before the region is still
read as a constant. Checked on Gloo ranks against the numbers."""

import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

TOKENS = 16


def _tokens(seed: int) -> torch.Tensor:
    return torch.randn(TOKENS, generator=torch.Generator().manual_seed(seed))


def _counted(shared: bool) -> dict:
    """Each rank counts its positive tokens (its own, untyped; or ``shared``: the same tokens
    on every rank, typed R) into replicated zeros, then SUM all-reduces the count."""
    own = _tokens(dist.get_rank())  # made before the region: no type, like a received tensor
    with sc.typecheck(sc.Mesh(dp=dist.group.WORLD), mode="collect"):
        tokens = sc.annotate(_tokens(0), dp=sc.R) if shared else own
        correct = (tokens > 0).sum().float()
        tracker = torch.zeros(2)
        tracker[0] += correct.detach()
        dist.all_reduce(tracker)
        return {"rules": sorted({v.rule for v in sc.violations()}), "count": tracker[0].item(),
                "type": sc.typeof(tracker)}


def _one_rank_count(seeds: list[int]) -> float:
    return float(sum((_tokens(seed) > 0).sum().item() for seed in seeds))


def test_a_count_of_each_ranks_own_tokens_summed_over_the_group_is_no_double_count():
    ranks = spawn_ranks(_counted, 2, False)
    assert [r["rules"] for r in ranks] == [[], []]
    assert all(r["type"] == {} for r in ranks)  # unknown: nothing said of a value of each rank's own
    assert all(r["count"] == _one_rank_count([0, 1]) for r in ranks)


def test_a_count_of_tokens_every_rank_holds_summed_over_the_group_is_a_double_count():
    ranks = spawn_ranks(_counted, 2, True)
    assert all("double count" in r["rules"] for r in ranks)
    assert all(r["count"] == 2 * _one_rank_count([0]) != _one_rank_count([0]) for r in ranks)


def test_a_one_element_tensor_made_before_the_region_is_still_a_constant():
    """A coefficient, or a loss scale (Megatron's optimizer keeps ``torch.tensor([1.0])``)."""
    coefficient, loss_scale, unseen = torch.tensor(0.5), torch.tensor([1.0]), torch.randn(3)
    with sc.typecheck(sc.Mesh(rank=0, dp=[0, 1])):
        x = sc.annotate(torch.ones(3), dp=sc.R)
        assert sc.typeof(x * coefficient) == {"dp": sc.R}
        assert sc.typeof(x * loss_scale) == {"dp": sc.R}
        computed = unseen.sum()  # no type: the sum of a tensor the region never typed
        assert sc.typeof(computed) == {}
        assert sc.typeof(x * computed) == {}
        assert sc.typeof(x * computed.view(1)) == {}
