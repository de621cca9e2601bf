"""MoE's permutation of each rank's own tokens by expert and its inverse (Megatron's argsort
permute, masked_select of the probabilities, per-expert split, scatter_add unpermute), on two
real Gloo ranks whose tokens are a row shard: the checker's types rebuilt against the one-rank
run, forward and backward, and what it claims nothing of."""

import pytest
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.pool import RankPool
from shardcheck.typecheck.types import SectionShard

TOKENS, EXPERTS, TOPK, HIDDEN = 8, 4, 2, 3


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    shapes = [(TOKENS, HIDDEN), (TOKENS, EXPERTS), (TOKENS, HIDDEN), (EXPERTS, HIDDEN, HIDDEN)]
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes]


def _sorted_positions(routing):
    """moe_utils.permute's argsort branch (megatron-core 0.19): the set entries' flat positions,
    and those modulo the rows (the rows)."""
    flat = routing.reshape(-1).argsort(descending=True, stable=True)[:int(routing.sum())]
    return flat % routing.shape[1], flat


def _masked_positions(routing):
    """moe_utils.permute's masked_select of the token positions (0.16): no flat positions."""
    return torch.arange(routing.shape[1]).unsqueeze(0).expand(EXPERTS, -1).masked_select(routing), None


POSITIONS = {"argsort": _sorted_positions, "masked_select": _masked_positions}


def _picked_probs(probs, routing, flat):
    """The probabilities of the set entries: read by their flat positions (0.19's argsort
    permute), else masked_select by the map (0.16's permute, 0.19's allgather dispatcher)."""
    transposed = probs.T.contiguous()
    return transposed.masked_select(routing) if flat is None else transposed.reshape(-1)[flat]


def permute(tokens, scores, positions="argsort"):
    """The rows routed to each expert, expert after expert, their probabilities, the index and
    the counts per expert (moe_utils.permute; the dispatcher's masked_select of the probs)."""
    top = scores.topk(TOPK, dim=1)
    probs = torch.zeros_like(scores).scatter(1, top.indices, top.values.softmax(-1))
    routing = torch.zeros_like(scores).scatter(1, top.indices, 1.0).bool().T.contiguous()
    index, flat = POSITIONS[positions](routing)
    return tokens.index_select(0, index), _picked_probs(probs, routing, flat), index, routing.sum(1).tolist()


def moe(tokens, scores, weights, zeros_rows=None, positions="argsort"):
    """Each expert's rows through its weight, scaled by their probabilities, added back into
    zeros of the tokens' rows (``zeros_rows`` other rows: the buggy unpermute)."""
    rows, picked, index, counts = permute(tokens, scores, positions)
    out = torch.cat([piece @ w * p.unsqueeze(-1) for piece, p, w
                     in zip(rows.split(counts), picked.split(counts), weights, strict=True)])
    zeros = out.new_zeros(zeros_rows or tokens.shape[0], HIDDEN)
    return zeros.scatter_add_(0, index.unsqueeze(1).expand(-1, HIDDEN), out)


def _program(tokens, scores, grad, weights, zeros_rows=None, positions="argsort"):
    """Values and their names: the permuted rows and probabilities, the output, the gradients."""
    tokens, scores, weights = (t.detach().requires_grad_(True) for t in (tokens, scores, weights))
    rows, picked, _, counts = permute(tokens, scores, positions)
    out = moe(tokens, scores, weights, zeros_rows, positions)
    (out * grad if zeros_rows is None else out).sum().backward()
    return {"rows": rows, "probs": picked, "out": out, "tokens.grad": tokens.grad,
            "scores.grad": scores.grad, "weights.grad": weights.grad}, counts


def _on_rank(ctx, zeros_rows=None, positions="argsort"):
    mesh = sc.Mesh(rank=ctx.rank, tp=ctx.groups["tp"])
    with sc.typecheck(mesh, mode="collect") as checker:
        tokens, scores, grad, weights = _inputs()
        rows = [sc.annotate(x.chunk(2)[ctx.rank].clone(), tp=sc.S(0)) for x in (tokens, scores, grad)]
        values, counts = _program(*rows, sc.annotate(weights, tp=sc.R), zeros_rows, positions)
        types = {name: checker.types(v) for name, v in values.items()}
        records = [r.rule for r in checker.records]
    return {n: v.detach().clone() for n, v in values.items()}, {n: t and t[0] for n, t in types.items()}, counts, records


def _router() -> torch.Tensor:
    return torch.randn(HIDDEN, EXPERTS, generator=torch.Generator().manual_seed(6), dtype=torch.float64)


def _routed(tokens, router, grad):
    """The router's scores of the tokens, routed through the experts; the output times the
    upstream gradient, summed and differentiated: the router weight's gradient."""
    router = router.detach().requires_grad_(True)
    (moe(tokens, tokens @ router, _inputs()[3]) * grad).sum().backward()
    return router


def _router_on_rank(ctx, reduced: bool):
    """Each rank's upstream gradient its own (V: the gradient of its part of the loss, as under
    context parallelism), so the probabilities' backward scatters V into zeros (masked_scatter,
    scatter). The router's gradient is V; summed over the ranks (DDP's reduction), R; left
    unsummed, the gradient check finds it."""
    mesh = sc.Mesh(rank=ctx.rank, tp=ctx.groups["tp"])
    with sc.typecheck(mesh, mode="collect") as checker:
        tokens, _, grad, _ = _inputs()
        rows = sc.annotate(tokens.chunk(2)[ctx.rank].clone(), tp=sc.S(0))
        own = sc.annotate(grad.chunk(2)[ctx.rank].clone(), tp=sc.V)
        router = _routed(rows, sc.annotate(_router(), tp=sc.R), own)
        sc.annotate(router, tp=sc.R)
        summed = checker.types(router.grad)
        if reduced:
            dist.all_reduce(router.grad, group=ctx.groups["tp"])
        found = [f.rule for f in sc.check_gradients([("router", router)])]
        records = [r.rule for r in checker.records]
    return router.grad.detach().clone(), summed, checker.types(router.grad), found, records


def _rebuild(placement, parts: list[torch.Tensor]) -> torch.Tensor:
    """The global value of the ranks' parts; sections are each rank's own (they differ by rank)."""
    if placement is sc.P:
        return sum(parts)
    if isinstance(placement, SectionShard):
        raise AssertionError("rebuilt by _sections")
    assert isinstance(placement, sc.Shard), placement
    return torch.cat(parts, placement.dim)


def _sections(parts: list[torch.Tensor], counts: list[list[int]]) -> torch.Tensor:
    pieces = [part.split(c) for part, c in zip(parts, counts, strict=True)]
    return torch.cat([piece for e in range(EXPERTS) for piece in (p[e] for p in pieces)])


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("positions", sorted(POSITIONS))
def test_tokens_grouped_by_each_rank_and_put_back_rebuild_the_one_rank_run(pool, positions):
    results = pool.run("tp2", _on_rank, None, positions)
    truth, _ = _program(*_inputs()[:3], _inputs()[3], None, positions)
    counts = [c for _, _, c, _ in results]
    assert counts[0] != counts[1] and not any(r for *_, r in results)
    for name in ("rows", "probs"):
        assert [types[name] for _, types, _, _ in results] == [SectionShard(0, tuple(c)) for c in counts]
        assert torch.allclose(_sections([values[name] for values, *_ in results], counts), truth[name])
    expected = {"out": sc.S(0), "tokens.grad": sc.S(0), "scores.grad": sc.S(0), "weights.grad": sc.P}
    for name, placement in expected.items():
        assert {types[name] for _, types, _, _ in results} == {placement}, name
        assert torch.allclose(_rebuild(placement, [values[name] for values, *_ in results]), truth[name]), name


def test_rows_put_back_into_zeros_of_every_token_claim_no_shard(pool):
    """Each rank adds its rows into zeros of all the tokens' rows: not the global output's cut."""
    results = pool.run("tp2", _on_rank, TOKENS)
    truth = moe(*_inputs()[:2], _inputs()[3], TOKENS)
    as_shard = torch.cat([values["out"] for values, *_ in results])
    assert as_shard.shape != truth.shape
    assert all(types["out"] in (None, sc.V) for _, types, _, _ in results)  # no claim


def test_own_gradients_through_the_router_are_varying_and_their_sum_is_the_one_rank_gradient(pool):
    truth = _routed(_inputs()[0], _router(), _inputs()[2]).grad
    for grad, before, after, found, records in pool.run("tp2", _router_on_rank, True):
        assert (before, after, found) == ((sc.V,), (sc.R,), []) and "unreduced gradient" not in records
        assert torch.allclose(grad, truth)


def test_an_unsummed_router_gradient_is_found(pool):
    results = pool.run("tp2", _router_on_rank, False)
    assert not torch.allclose(results[0][0], _routed(_inputs()[0], _router(), _inputs()[2]).grad)
    assert all(after == (sc.V,) and found == ["unreduced gradient"] for _, _, after, found, _ in results)
