"""Scatter into zeros (MoE's top-k routing map and the backward of its probabilities), on two
real Gloo ranks: the type the checker gives is rebuilt and compared with the one-rank run."""

import pytest
import torch

import shardcheck as sc
from shardcheck.fuzz.oracle import encode, rebuild
from shardcheck.parity.pool import RankPool

TOKENS, EXPERTS, TOPK = 8, 4, 2


def _scores(seed: int = 3) -> torch.Tensor:
    return torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def routed_probs(scores: torch.Tensor) -> torch.Tensor:
    """Megatron's top-k router: the softmax of each token's top scores, scattered into zeros."""
    top = scores.topk(TOPK, dim=1)
    return torch.zeros_like(scores).scatter(1, top.indices, top.values.softmax(-1))


def routing_map(scores: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(scores).scatter(1, scores.topk(TOPK, dim=1).indices, 1.0)


def probs_gradient(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The scores' gradient through the router (its backward gathers, then scatters the
    gradient into zeros of the scores' shape)."""
    scores = scores.detach().requires_grad_(True)
    (routed_probs(scores) * weights).sum().backward()
    return scores.grad


def into_zeros_of_the_whole(scores: torch.Tensor) -> torch.Tensor:
    """Wrong for a row shard: each rank writes its rows into zeros of all the tokens' rows."""
    top = scores.topk(TOPK, dim=1)
    zeros = torch.zeros(TOKENS, EXPERTS, dtype=scores.dtype)
    return zeros.scatter(1, top.indices, top.values)


PROGRAMS = {"routed_probs": routed_probs, "routing_map": routing_map, "probs_gradient": probs_gradient,
            "into_zeros_of_the_whole": into_zeros_of_the_whole}


def _global_inputs(name: str) -> list[torch.Tensor]:
    return [_scores(), _scores(4)] if name == "probs_gradient" else [_scores()]


def _on_rank(ctx, name: str):
    """This rank's rows of the inputs, typed S(0); the program's output, its type, the reports."""
    mesh = sc.Mesh(rank=ctx.rank, tp=ctx.groups["tp"])
    with sc.typecheck(mesh, mode="collect") as checker:
        rows = [sc.annotate(x.chunk(2)[ctx.rank].clone(), tp=sc.S(0)) for x in _global_inputs(name)]
        out = PROGRAMS[name](*rows)
        pl = checker.types(out)
        records = [r.rule for r in checker.records]
    return out.detach().clone(), None if pl is None else tuple(encode(p) for p in pl), records


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("name", ["routed_probs", "routing_map", "probs_gradient"])
def test_rows_scattered_into_zeros_rebuild_the_one_rank_value(pool, name):
    results = pool.run("tp2", _on_rank, name)
    [types] = {types for _, types, _ in results}
    assert types == (("S", 0),) and not any(records for _, _, records in results)
    assert torch.allclose(rebuild("tp2", [value for value, _, _ in results], [types[0]]),
                          PROGRAMS[name](*_global_inputs(name)))


def test_rows_scattered_into_zeros_of_every_row_claim_no_cut(pool):
    results = pool.run("tp2", _on_rank, "into_zeros_of_the_whole")
    as_row_shard = rebuild("tp2", [value for value, _, _ in results], [("S", 0)])
    assert as_row_shard.shape != into_zeros_of_the_whole(_scores()).shape  # S(0) would be wrong
    assert [types for _, types, _ in results] == [None, None]


def _mask(scores: torch.Tensor) -> torch.Tensor:
    return routing_map(scores).bool()


def _picks(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Values to put where the mask is set (the probabilities' gradient, in row-major order)."""
    return (scores * 10).masked_select(mask)


# mask, source: each "rows" (this rank's rows and their picks: S(0)), "whole" (every rank the
# one-rank value: R), "own" (a rank's own values, as a gradient under context parallelism: V)
MASKED = {("whole", "whole"): ("R",), ("rows", "rows"): ("S", 0), ("rows", "own"): ("V",),
          ("whole", "own"): ("V",), ("own", "whole"): ("V",), ("own", "own"): ("V",)}


def _masked_on_rank(ctx, mask_kind: str, source_kind: str):
    """zeros.masked_scatter(mask, source) with the mask and source of the kinds named."""
    mesh = sc.Mesh(rank=ctx.rank, tp=ctx.groups["tp"])
    with sc.typecheck(mesh, mode="collect") as checker:
        scores = sc.annotate(_scores(), tp=sc.R)  # the same seed on every rank
        rows = scores.chunk(2)[ctx.rank].clone()
        whole, own = _mask(scores), _mask(_scores(5 + ctx.rank).chunk(2)[0])
        mask = {"whole": (whole, sc.R), "rows": (_mask(rows), sc.S(0)), "own": (own, sc.V),
                "partial": (_mask(rows), sc.P)}[mask_kind]
        mask = sc.annotate(mask[0], tp=mask[1])
        count = int(mask.sum())
        source = {"whole": lambda: (_picks(scores, whole)[:count].clone(), sc.R),
                  "rows": lambda: (_picks(rows, mask), sc.S(0)),
                  "own": lambda: (torch.randn(count, generator=torch.Generator().manual_seed(ctx.rank),
                                              dtype=torch.float64), sc.V)}[source_kind]()
        source = sc.annotate(*source[:1], tp=source[1])
        zeros = torch.zeros(TOKENS if mask_kind == "whole" else TOKENS // 2, EXPERTS, dtype=torch.float64)
        out = zeros.masked_scatter(mask, source)
        pl = checker.types(out)
        records = [r.rule for r in checker.records]
    return out.detach().clone(), None if pl is None else encode(pl[0]), records


@pytest.mark.parametrize("kinds", sorted(MASKED))
def test_masked_scatter_into_zeros_is_typed_from_its_mask_and_source(pool, kinds):
    """Replicated or row-cut mask and source rebuild the one-rank value; a rank's own values,
    or values put where a rank's own mask says, differ per rank with no global value: V."""
    results = pool.run("tp2", _masked_on_rank, *kinds)
    assert [(pl, records) for _, pl, records in results] == [(MASKED[kinds], [])] * 2
    values = [value for value, _, _ in results]
    if MASKED[kinds] == ("V",):
        assert not torch.equal(values[0], values[1])  # R would be wrong
        return
    mask = _mask(_scores())
    truth = torch.zeros(TOKENS, EXPERTS, dtype=torch.float64).masked_scatter(mask, _picks(_scores(), mask))
    assert torch.equal(rebuild("tp2", values, [MASKED[kinds]]), truth)


def test_masked_scatter_by_a_partial_mask_is_a_violation(pool):
    assert [records for _, _, records in pool.run("tp2", _masked_on_rank, "partial", "own")] == \
        [["non-linear on partial"]] * 2
