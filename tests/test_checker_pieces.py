"""Pieces put back together on real Gloo ranks: the halves of a split used as the plain values
they are (Megatron's fused vocab-parallel cross-entropy), a constant softmax sink concatenated to
head-sharded scores (softmax off-by-one), this rank's chunk of a reduced value joined side by side
with sequence shards (CP's query, key and value gradients), gradients all-reduced in one coalesced
buffer and viewed back (Megatron's finalize_model_grads), each with a buggy variant that is still
flagged."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

TOKENS, VOCAB, HEADS, SEQ = 4, 6, 4, 3


def _global(seed: int, *shape: int) -> torch.Tensor:
    value = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return sc.annotate(value, tp=sc.R)


def _logits_and_target() -> tuple[torch.Tensor, torch.Tensor]:
    return _global(0, TOKENS, VOCAB), torch.arange(TOKENS) % VOCAB


def fused_cross_entropy(reduce: bool) -> torch.Tensor:
    """Both vocab-parallel partial sums in one all-reduce, split back into halves (``reduce=False``
    forgets the all-reduce: log of a partial sum)."""
    logits, target = _logits_and_target()
    local = sc.rank_slice(logits, "tp", 1)
    hits = sc.rank_slice(F.one_hot(target, VOCAB).float(), "tp", 1)
    both = torch.cat(((local * hits).sum(-1), local.exp().sum(-1)))
    if reduce:
        dist.all_reduce(both)
    predicted, sum_exp = torch.split(both, TOKENS)
    return torch.log(sum_exp) - predicted


def chunk_by_rank_added(dim: int) -> torch.Tensor:
    """This rank's chunk of a replicated bias added to a column-parallel output: chunked on the
    output's sharded dim (right) or on another dim (wrong: it is no piece of the output)."""
    n, r = dist.get_world_size(), dist.get_rank()
    column = sc.rank_slice(_global(1, TOKENS, 2 * n), "tp", 1)
    bias = _global(2, TOKENS * (n if dim == 0 else 1), 2 * n // (n if dim == 0 else 1))
    return column + bias.chunk(n, dim=dim)[r]


def _scores() -> torch.Tensor:
    return sc.rank_slice(_global(3, 1, HEADS, SEQ, SEQ), "tp", 1)


def _softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    column = sink.reshape(1, -1, 1, 1).expand(scores.size(0), -1, scores.size(2), -1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def softmax_with_sink(kind: str) -> torch.Tensor:
    """Softmax off-by-one over head-sharded scores: a zero sink per local head (constant), each
    rank's own heads' offsets, or the first heads' offsets on every rank (wrong on rank 1)."""
    local_heads = HEADS // dist.get_world_size()
    offsets = _global(4, HEADS)
    sink = {"zeros": lambda: torch.zeros(local_heads),
            "own heads": lambda: sc.rank_slice(offsets, "tp", 0),
            "first heads": lambda: offsets[:local_heads] * 1}[kind]()
    return _softmax_with_sink(_scores(), sink)


def chunk_beside_shards(kind: str) -> torch.Tensor:
    """Sequence shards joined along the feature dim with this rank's chunk of a summed value,
    as CP's attention backward joins the query, key and value gradients: the key's normalised
    after the sum (a plain shard), the value's chunked by rank from it; the query's own
    contribution (V) beside them, or the first chunk on every rank (wrong on rank 1)."""
    n, r = dist.get_world_size(), dist.get_rank()
    summed = sc.annotate(_global(5, TOKENS * n, 2) / n, tp=sc.P)
    dist.all_reduce(summed)
    chunk = summed.chunk(n, dim=0)[0 if kind == "first chunk" else r]
    key = F.layer_norm(sc.rank_slice(_global(6, TOKENS * n, 2), "tp", 0), (2,))
    if kind == "beside a contribution":
        own = sc.annotate(torch.full((TOKENS, 2), float(r)), tp=sc.V)
        return torch.cat([own, key, chunk], dim=1)
    return torch.cat([key, chunk], dim=1)


def coalesced_gradients(kind: str) -> torch.Tensor:
    """Two partial gradients of one size summed over tp in one flat buffer and viewed back
    (``torch._utils._unflatten_dense_tensors``, as Megatron's sequence-parallel gradient sum):
    the second view is rank 1's half of the buffer by its place, not by the rank, so both are R
    on every rank. The buggy variant keeps each rank's own chunk of the buffer."""
    n = dist.get_world_size()
    grads = [sc.annotate(torch.randn(2, n, generator=torch.Generator().manual_seed(7 + i)), tp=sc.P)
             for i in range(2)]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    if kind == "own chunk":
        return flat.chunk(n)[dist.get_rank()] * 1
    return torch.cat([grad.flatten() for grad in torch._utils._unflatten_dense_tensors(flat, grads)])


def fused_output_gradient(reduced: bool) -> torch.Tensor:
    """The weight gradient of a fused column-parallel linear whose output's two pieces were each
    gathered over tp in forward (MLA's fused down projection): the gather's backward takes this
    rank's chunk of each piece's gradient, the split's joins them (the fused output's sections)
    and the weight's is their product with the input. The buggy variant leaves the second
    piece's gradient a partial sum (the rotary key's, unreduced)."""
    n, r = dist.get_world_size(), dist.get_rank()
    first, second = _global(8, TOKENS, 2 * n), _global(9, TOKENS, 3 * n)
    if not reduced:
        second = sc.annotate(second / n, tp=sc.P)
    joined = torch.cat([first.chunk(n, dim=-1)[r], second.chunk(n, dim=-1)[r]], dim=-1)
    return joined.t() @ _global(10, TOKENS, 3)


def _run(program, variant) -> dict:
    with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):
        value = program(variant)
        types = {axis: repr(p) for axis, p in sc.typeof(value).items()}
    return {"value": value.tolist(), "types": types,
            "rules": [v.rule for v in sc.violations()]}


VARIANTS = [(fused_cross_entropy, True), (fused_cross_entropy, False), (chunk_by_rank_added, 1),
            (chunk_by_rank_added, 0), (softmax_with_sink, "zeros"),
            (softmax_with_sink, "own heads"), (softmax_with_sink, "first heads"),
            (chunk_beside_shards, "own chunk"), (chunk_beside_shards, "beside a contribution"),
            (chunk_beside_shards, "first chunk"), (coalesced_gradients, "views"),
            (coalesced_gradients, "own chunk"), (fused_output_gradient, True),
            (fused_output_gradient, False)]


def _ranks() -> dict:
    return {(program.__name__, variant): _run(program, variant) for program, variant in VARIANTS}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_ranks, 2)


def test_halves_of_a_reduced_split_are_replicated_and_give_the_one_rank_loss(ranks):
    logits, target = torch.randn(TOKENS, VOCAB, generator=torch.Generator().manual_seed(0)), \
        torch.arange(TOKENS) % VOCAB
    reference = F.cross_entropy(logits, target, reduction="none")
    for rank in ranks:
        result = rank[("fused_cross_entropy", True)]
        assert (result["types"], result["rules"]) == ({"tp": "R"}, [])
        assert torch.tensor(result["value"]) == pytest.approx(reference, abs=1e-5)


def test_halves_of_an_unreduced_split_are_flagged(ranks):
    for rank in ranks:
        assert rank[("fused_cross_entropy", False)]["rules"] == ["non-linear on partial"]


def test_a_chunk_by_rank_lines_up_only_on_the_sharded_dim(ranks):
    for rank in ranks:
        right = rank[("chunk_by_rank_added", 1)]
        assert (right["types"], right["rules"]) == ({"tp": "S(1)"}, [])
        assert rank[("chunk_by_rank_added", 0)]["rules"] == ["global shape mismatch"]


def test_a_constant_sink_or_each_ranks_own_offsets_fit_head_sharded_scores(ranks):
    for rank in ranks:
        for variant in ("zeros", "own heads"):
            result = rank[("softmax_with_sink", variant)]
            assert (result["types"], result["rules"]) == ({"tp": "S(1)"}, []), variant


def test_the_first_heads_offsets_on_every_rank_are_flagged_where_they_are_wrong(ranks):
    # on rank 0 the first heads are its own (the slice reads as its shard), as in the bias test
    assert [rank[("softmax_with_sink", "first heads")]["rules"] for rank in ranks] == [
        [], ["global shape mismatch"]]
    own = [rank[("softmax_with_sink", "own heads")]["value"] for rank in ranks]
    first = [rank[("softmax_with_sink", "first heads")]["value"] for rank in ranks]
    assert own[0] == first[0] and own[1] != first[1]  # rank 1 really uses the wrong offsets


def _joined_globally(ranks, variant: str) -> torch.Tensor:
    return torch.cat([torch.tensor(rank[("chunk_beside_shards", variant)]["value"]) for rank in ranks])


def test_a_ranks_chunk_beside_sequence_shards_is_their_shard_of_the_joined_value(ranks):
    n = len(ranks)
    gen = torch.Generator().manual_seed
    summed, key = torch.randn(TOKENS * n, 2, generator=gen(5)), torch.randn(TOKENS * n, 2, generator=gen(6))
    reference = torch.cat([F.layer_norm(key, (2,)), summed], dim=1)
    for rank in ranks:
        result = rank[("chunk_beside_shards", "own chunk")]
        assert (result["types"], result["rules"]) == ({"tp": "S(0)"}, [])
        beside = rank[("chunk_beside_shards", "beside a contribution")]
        assert (beside["types"], beside["rules"]) == ({"tp": "V"}, [])
    assert _joined_globally(ranks, "own chunk") == pytest.approx(reference, abs=1e-5)


def test_the_first_chunk_on_every_rank_beside_shards_is_flagged_where_it_is_wrong(ranks):
    assert [rank[("chunk_beside_shards", "first chunk")]["rules"] for rank in ranks] == [
        [], ["global shape mismatch"]]
    assert _joined_globally(ranks, "first chunk") != pytest.approx(_joined_globally(ranks, "own chunk"))


def test_gradients_viewed_back_from_a_coalesced_sum_are_replicated_and_a_ranks_chunk_is_its_shard(ranks):
    n = len(ranks)
    summed = torch.cat([n * torch.randn(2, n, generator=torch.Generator().manual_seed(7 + i)).flatten()
                        for i in range(2)])
    for rank in ranks:
        views = rank[("coalesced_gradients", "views")]
        assert (views["types"], views["rules"]) == ({"tp": "R"}, [])
        assert torch.tensor(views["value"]) == pytest.approx(summed, abs=1e-5)
        assert rank[("coalesced_gradients", "own chunk")]["types"] == {"tp": "S(0)"}


def test_ranks_chunks_of_two_gathered_gradients_joined_are_the_fused_weights_sections(ranks):
    n = len(ranks)
    gen = torch.Generator().manual_seed
    first, second, x = (torch.randn(TOKENS, k, generator=gen(seed)) for seed, k in ((8, 2 * n), (9, 3 * n), (10, 3)))
    reference = torch.cat([first, second], dim=1).t() @ x  # the one-rank fused weight's gradient
    pieces = [torch.tensor(rank[("fused_output_gradient", True)]["value"]).split([2, 3]) for rank in ranks]
    joined = torch.cat([torch.cat([piece[k] for piece in pieces]) for k in range(2)])
    assert joined == pytest.approx(reference, abs=1e-5)
    for rank in ranks:
        right = rank[("fused_output_gradient", True)]
        assert (right["types"], right["rules"]) == ({"tp": "S(0, sections=[2, 3])"}, [])
        assert rank[("fused_output_gradient", False)]["rules"] == ["affine on partial"]
