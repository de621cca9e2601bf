"""Three idioms of Megatron under tp2 on real Gloo ranks, checked against the one-rank numbers.

- A replicated tensor cut into as many chunks as there are tp ranks, each chunk run through a
  column-parallel layer (``mlp_chunks_for_training``, the MTP hidden states): the rank-slice
  heuristic takes this rank's chunk for its shard, a guess that does not line up with the
  weight's shard; the chunk is then the replicated value it is on every rank.
- One key head shared by every tp rank (``num_query_groups`` below the tp size): the key,
  repeated to the rank's query heads and merged with the batch dim, holds one value in each
  batch block, so it fits the queries' head shard in those blocks.
- The attention mask filled in place into a view of the head-sharded scores: autograd's
  backward of the view writes the scores' gradient into a flat zero buffer through a view of
  all of it, and the buffer holds the written shard (the gradients of the layers below keep
  their types to the optimizer step).

Each program's result is rebuilt from its checked type and compared with the one-rank run;
a buggy variant on the same path is rejected.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from grad_programs import CopyToRegion, ReduceFromRegion

import shardcheck as sc
from shardcheck.fuzz.oracle import encode, matches
from shardcheck.parity.launch import spawn_ranks
from shardcheck.typecheck.checker import current

pytestmark = pytest.mark.slow
# The heads over both ranks, three on each: with a multiple of BATCH on each rank, the key's
# heads merged outside its batch repeat every BATCH rows in whole repeats on each rank, and the
# bug computes on two ranks what it computes on one (no SPMD bug, though a bug).
SEQ, BATCH, HEADS, HEAD_DIM = 3, 2, 6, 2
HIDDEN, FFN = 3, 4


def _inputs(*shapes):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in shapes]


def _own(t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    """This rank's half of ``t`` along ``dim``, as a leaf."""
    return t.chunk(2, dim)[rank].clone().requires_grad_()


def _scores(query, key, heads: int, key_heads_outer: bool = False):
    """Megatron's DotProductAttention scores with one key head: the key repeated to the query
    heads, both merged with the batch dim, then baddbmm. ``key_heads_outer``: the bug of
    merging the key's heads outside its batch (its rows no longer pair with the queries')."""
    key = key.repeat_interleave(heads, dim=2)
    q = query.reshape(SEQ, BATCH * heads, HEAD_DIM).transpose(0, 1)
    if key_heads_outer:
        key = key.transpose(1, 2).reshape(SEQ, heads * BATCH, HEAD_DIM)
    k = key.view(SEQ, BATCH * heads, HEAD_DIM).transpose(0, 1).transpose(1, 2)
    return torch.baddbmm(torch.empty(BATCH * heads, SEQ, SEQ, dtype=q.dtype), q, k, beta=0.0, alpha=0.5)


def _chunked_mlp(x, fc1, fc2, reduce, chunks: int = 2):
    """Megatron's MLP over sequence chunks: fc1 column-parallel, gelu, fc2 row-parallel, the
    tp all-reduce (``reduce``, left out by the bug: gelu then sees a partial sum)."""
    outs = []
    for chunk in x.chunk(chunks, 0):
        y = F.linear(F.gelu(F.linear(chunk, fc1)), fc2)
        outs.append(reduce(y))
    return F.gelu(torch.cat(outs, 0))


def _all_reduce(y):
    return ReduceFromRegion.apply(y, dist.group.WORLD)


def _typed(t: torch.Tensor, placement) -> torch.Tensor:
    """``t`` with its tp placement, when the checker runs."""
    return sc.annotate(t, tp=placement) if current() else t


def _checked(program):
    """('ok', values, types) or ('error', the first rule broken), checked on this rank in
    collect mode (every rank runs the program to its end: the collectives stay in step)."""
    with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):
        out, grads = program()
        broken = [v.rule for v in sc.violations()]
        types = [encode(sc.typeof(t).get("tp")) for t in (out, *grads)]
    if broken:
        return ("error", broken[0])
    return ("ok", [t.detach() for t in (out, *grads)], types)


def _attention(bug: bool):
    query, key = _inputs((SEQ, BATCH, HEADS, HEAD_DIM), (SEQ, BATCH, 1, HEAD_DIM))
    q = _typed(_own(query, 2, dist.get_rank()), sc.S(2))
    k = _typed(key.clone().requires_grad_(), sc.R)
    scores = _scores(q, k, HEADS // 2, key_heads_outer=bug)
    scores.pow(2).sum().backward()
    return scores, [q.grad]


def _mlp(bug: bool):
    x, fc1, fc2 = _inputs((4, BATCH, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN))
    rank = dist.get_rank()
    w1, w2 = _typed(_own(fc1, 0, rank), sc.S(0)), _typed(_own(fc2, 1, rank), sc.S(1))
    out = _chunked_mlp(_typed(x, sc.R), w1, w2, (lambda y: y) if bug else _all_reduce)
    out.pow(2).sum().backward()
    return out, [w1.grad, w2.grad]


def _masked(bug: bool):
    """Causal scores of the rank's heads, masked in place through a 4-d view, softmax; the
    bug: the sharded query passed through a copy-to-region, whose backward sums its
    gradient over tp (every rank's heads added up)."""
    (query,) = _inputs((HEADS, SEQ, HEAD_DIM))
    q = _typed(_own(query, 0, dist.get_rank()), sc.S(0))
    used = CopyToRegion.apply(q, dist.group.WORLD) if bug else q
    scores = torch.bmm(used, used.transpose(1, 2))
    view = scores.view(1, *scores.shape)
    view.masked_fill_(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), -1e4)
    probs = view.softmax(-1)
    probs.pow(2).sum().backward()
    if current():
        sc.check_gradients({"query": q})
    return probs, [q.grad]


PROGRAMS = {"attention": _attention, "mlp": _mlp, "masked": _masked}


def _on_ranks():
    """Each program checked, correct and buggy; and the buggy one's values unchecked."""
    results = {(name, bug): _checked(lambda p=program, b=bug: p(b))
               for name, program in PROGRAMS.items() for bug in (False, True)}
    for name, program in PROGRAMS.items():
        out, grads = program(True)
        results[(name, "unchecked")] = [out.detach(), *grads]
    return results


def _one_rank():
    """The programs' values and gradients on one rank."""
    query, key = _inputs((SEQ, BATCH, HEADS, HEAD_DIM), (SEQ, BATCH, 1, HEAD_DIM))
    q = query.clone().requires_grad_()
    scores = _scores(q, key, HEADS)
    scores.pow(2).sum().backward()
    x, fc1, fc2 = _inputs((4, BATCH, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN))
    w1, w2 = fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
    out = _chunked_mlp(x, w1, w2, lambda y: y)
    out.pow(2).sum().backward()
    (query,) = _inputs((HEADS, SEQ, HEAD_DIM))
    q2 = query.clone().requires_grad_()
    view = torch.bmm(q2, q2.transpose(1, 2)).view(1, HEADS, SEQ, SEQ)
    probs = view.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), -1e4).softmax(-1)
    probs.pow(2).sum().backward()
    return {"attention": [scores.detach(), q.grad], "mlp": [out.detach(), w1.grad, w2.grad],
            "masked": [probs.detach(), q2.grad]}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_on_ranks, 2)


@pytest.mark.parametrize("name, types", [
    ("attention", [("B", 0, BATCH), ("S", 2)]),  # the scores in batch blocks, the query's grad
    ("mlp", [("R",), ("S", 0), ("S", 1)]),
    ("masked", [("S", 1), ("S", 0)]),
])
def test_the_correct_program_is_accepted_and_its_types_rebuild_the_one_rank_values(ranks, name, types):
    truth = _one_rank()[name]
    for rank in ranks:
        assert rank[(name, False)][0] == "ok", rank[(name, False)]
        assert rank[(name, False)][2] == types
    for i, expected in enumerate(truth):
        assert matches("tp2", [rank[(name, False)][1][i] for rank in ranks], [types[i]], expected)


@pytest.mark.parametrize("name, rule", [
    ("attention", "global shape mismatch"),  # the key's heads merged outside its batch
    ("mlp", "non-linear on partial"),  # each chunk's tp all-reduce left out
    ("masked", "gradient type mismatch"),  # the query's gradient summed over its shards
])
def test_the_buggy_variant_is_rejected(ranks, name, rule):
    assert [rank[(name, True)] for rank in ranks] == [("error", rule)] * 2


@pytest.mark.parametrize("name, value, types", [
    ("attention", 0, [("B", 0, BATCH)]), ("mlp", 0, [("R",)]), ("masked", 1, [("S", 0)])])
def test_the_buggy_variants_are_wrong_on_the_numbers(ranks, name, value, types):
    """Run unchecked, each buggy variant's value (or gradient) differs from the one-rank run."""
    values = [rank[(name, "unchecked")][value] for rank in ranks]
    assert not matches("tp2", values, types, _one_rank()[name][value])
