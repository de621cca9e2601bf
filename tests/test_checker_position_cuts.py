"""A sequence shard cut into pieces, each piece run through a sequence-parallel MLP, the results
joined again (Megatron's ``mlp_chunks_for_training``), on real Gloo ranks: joined in order it is
the source's shard again, forward and backward, and equals the one-rank run; joined out of
order, or an independent pair of shards joined, it is still flagged."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

SEQ, HIDDEN, FFN, PIECES = 8, 4, 6, 2


class _Gather(torch.autograd.Function):
    """All-gather of sequence shards; the gradient is reduce-scattered (Megatron's mappings)."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.forward(None, grad)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return _Gather.forward(None, grad)


def _weights(tp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    up, down = torch.randn(HIDDEN, FFN, generator=gen), torch.randn(FFN, HIDDEN, generator=gen)
    if not tp:
        return up, down
    return (sc.rank_slice(sc.annotate(up, tp=sc.R), "tp", 1),
            sc.rank_slice(sc.annotate(down, tp=sc.R), "tp", 0))


def _mlp(rows: torch.Tensor, weights, tp: bool) -> torch.Tensor:
    up, down = weights
    gathered = _Gather.apply(rows) if tp else rows
    partial = F.gelu(gathered @ up) @ down
    return _ReduceScatter.apply(partial) if tp else partial


def _source(tp: bool) -> torch.Tensor:
    x = torch.randn(SEQ, HIDDEN, generator=torch.Generator().manual_seed(0))
    if tp:
        x = sc.rank_slice(sc.annotate(x, tp=sc.R), "tp", 0)
    return x.requires_grad_()


def chunked_block(join: str, tp: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual block whose MLP runs piece by piece: joined in order, swapped, or the pieces
    of a different tensor (the block's input plus one) joined (wrong: independent shards)."""
    x, weights = _source(tp), _weights(tp)
    normed = F.layer_norm(x, (HIDDEN,))
    pieces = normed.chunk(PIECES, dim=0)
    if join == "others":
        pieces = (normed + 1).chunk(PIECES, dim=0)[:1] + pieces[1:]
    outs = [_mlp(piece, weights, tp) for piece in pieces]
    joined = torch.cat(outs[::-1] if join == "swapped" else outs, dim=0)
    out = x + joined
    out.square().sum().backward()
    return out, x.grad


def _run(join: str) -> dict:
    with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):
        out, grad = chunked_block(join)
        types = {axis: repr(p) for axis, p in sc.typeof(out).items()}
    return {"out": out.tolist(), "grad": grad.tolist(), "types": types,
            "rules": sorted({(v.rule, v.location.split(":")[0].endswith("test_checker_position_cuts.py"))
                             for v in sc.violations()})}


def _ranks() -> dict:
    return {join: _run(join) for join in ("in order", "swapped", "others")}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_ranks, 2)


def _joined(ranks, join: str, what: str) -> torch.Tensor:
    return torch.cat([torch.tensor(rank[join][what]) for rank in ranks])


def test_pieces_joined_in_order_are_the_sources_shard_and_match_one_rank(ranks):
    out, grad = chunked_block("in order", tp=False)
    for rank in ranks:
        assert (ranks[0]["in order"]["types"], rank["in order"]["rules"]) == ({"tp": "S(0)"}, [])
    assert _joined(ranks, "in order", "out") == pytest.approx(out.detach(), abs=1e-5)
    assert _joined(ranks, "in order", "grad") == pytest.approx(grad, abs=1e-4)


def test_pieces_joined_out_of_order_are_flagged_and_are_wrong(ranks):
    out, _ = chunked_block("swapped", tp=False)
    assert all(("mixed shards", True) in rank["swapped"]["rules"] for rank in ranks)
    assert _joined(ranks, "swapped", "out") != pytest.approx(out.detach(), abs=1e-3)


def test_pieces_of_two_tensors_joined_are_no_rejoined_cut(ranks):
    assert all(("mixed shards", True) in rank["others"]["rules"] for rank in ranks)
