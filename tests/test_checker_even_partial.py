"""Even partials on real Gloo ranks: a token count over a sequence shard of a constant mask is
the same on every rank, so Megatron's per-rank "loss sum / clamp(count)" is a correct mean over
equal shards; with a real (uneven) mask the same lines are flagged and the numbers are wrong."""

import pytest
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

TOKENS = 8


def _global_losses_and_mask(masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    losses = torch.arange(1.0, TOKENS + 1).sin().abs()
    if not masked:
        return losses, torch.ones(TOKENS)
    mask = torch.ones(TOKENS)
    mask[-3:] = 0
    return losses, mask


def _shards(masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sequence shard of the losses and the mask, built inside the checker."""
    losses, mask = _global_losses_and_mask(masked)
    return sc.rank_slice(losses, "cp", 0), sc.rank_slice(mask, "cp", 0)


def clamped_count_loss(masked: bool) -> torch.Tensor:
    """Megatron's schedules: each rank divides its masked loss sum by clamp(its count, min=1)."""
    losses, mask = _shards(masked)
    count = mask.sum().to(torch.int)
    return (losses * mask).sum() / torch.clamp(count, min=1)  # LINE: clamp


def count_divided_loss(masked: bool) -> torch.Tensor:
    """The same without the guard: loss sum / count of the shard."""
    losses, mask = _shards(masked)
    return (losses * mask).sum() / mask.sum()  # LINE: divide


def even_ratio(masked: bool) -> torch.Tensor:
    """A ratio of two even shares is the ratio of the totals on every rank."""
    _, mask = _shards(masked)
    return (2 * mask).sum() / mask.sum()


def _line(tag: str) -> str:
    with open(__file__) as source:
        number = next(n for n, text in enumerate(source, 1) if text.rstrip().endswith(f"# LINE: {tag}"))
    return f"{__file__}:{number}"


def _run(program, masked: bool) -> dict:
    with sc.typecheck(sc.Mesh(cp=dist.group.WORLD), mode="collect"):
        value = program(masked)
        types = {axis: repr(p) for axis, p in sc.typeof(value).items()}
    return {"value": float(value), "types": types,
            "violations": [(v.rule, v.location) for v in sc.violations()]}


def _ranks() -> dict:
    return {(program.__name__, masked): _run(program, masked)
            for program in (clamped_count_loss, count_divided_loss, even_ratio)
            for masked in (False, True)}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_ranks, 2)


def _reference(masked: bool) -> float:
    losses, mask = _global_losses_and_mask(masked)
    return float((losses * mask).sum() / mask.sum())


def _mean_over_ranks(ranks, key) -> float:
    return sum(rank[key]["value"] for rank in ranks) / len(ranks)


@pytest.mark.parametrize("program", ["clamped_count_loss", "count_divided_loss"])
def test_dividing_by_the_count_of_a_constant_mask_is_a_mean_over_shards(ranks, program):
    for rank in ranks:
        assert rank[(program, False)]["violations"] == []
        assert rank[(program, False)]["types"] == {"cp": "P(avg)"}
    assert _mean_over_ranks(ranks, (program, False)) == pytest.approx(_reference(False))


def test_clamping_the_count_of_an_uneven_mask_is_flagged_and_really_wrong(ranks):
    for rank in ranks:
        assert ("non-linear on partial", _line("clamp")) in rank[("clamped_count_loss", True)]["violations"]
    assert _mean_over_ranks(ranks, ("clamped_count_loss", True)) != pytest.approx(_reference(True))


def test_dividing_by_the_count_of_an_uneven_mask_is_flagged(ranks):
    for rank in ranks:
        assert rank[("count_divided_loss", True)]["violations"] == [
            ("division by partial", _line("divide"))]
    assert _mean_over_ranks(ranks, ("count_divided_loss", True)) != pytest.approx(_reference(True))


def test_a_ratio_of_even_shares_is_replicated_and_an_uneven_one_is_flagged(ranks):
    for rank in ranks:
        assert rank[("even_ratio", False)] == {"value": 2.0, "types": {"cp": "R"}, "violations": []}
        assert [rule for rule, _ in rank[("even_ratio", True)]["violations"]] == ["division by partial"]
