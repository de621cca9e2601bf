"""Branches on the rank, on real Gloo ranks: a value changed on one rank only is no longer
typed R (each rank ran other ops), while the idioms of real code keep their types: a rank's
own slice picked in a branch, zeros one rank accumulates into and then all-reduces, a rank
used as an index only, and code that reads the rank without branching on it; past the
branch the rules hold again."""

import dis

import pytest
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks
from shardcheck.typecheck import rank_branches


def _replicated() -> torch.Tensor:
    return sc.annotate(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), tp=sc.R)


def changed_on_first_rank() -> torch.Tensor:
    x = _replicated()
    if dist.get_rank() == 0:
        x = x + 1.0
    return x * 2


def own_rows_by_branch() -> torch.Tensor:
    x = _replicated()
    return x[:2] if dist.get_rank() == 0 else x[2:]


def accumulated_on_first_rank_then_summed() -> torch.Tensor:
    x = _replicated()
    acc = torch.zeros_like(x)
    if dist.get_rank() == 0:
        acc += x
    dist.all_reduce(acc)
    return acc


def accumulated_on_first_rank_then_scaled() -> torch.Tensor:
    """An op on one rank's contribution: the value itself or that rank's part, V there."""
    x = _replicated()
    acc = torch.zeros_like(x)
    if dist.get_rank() == 0:
        acc += x
    return acc * 2


def accumulated_on_every_rank_then_scaled() -> torch.Tensor:
    """Zeros every rank adds into (an optimizer's zero states): the value itself, R."""
    acc = torch.zeros_like(_replicated())
    acc += _replicated()
    return acc * 2


def rank_as_an_index() -> torch.Tensor:
    return _replicated().chunk(dist.get_world_size(), 0)[dist.get_rank()] * 2


def _partial() -> torch.Tensor:
    return sc.annotate(torch.randn(4, 6, generator=torch.Generator().manual_seed(2)), tp=sc.P)


def partial_chunk_by_rank() -> torch.Tensor:
    """One rank's chunk of each rank's part of a sum: no layout of the sum (V)."""
    return _partial().chunk(dist.get_world_size(), 0)[dist.get_rank()] * 2


def partial_chunk_by_a_rank_helper() -> torch.Tensor:
    """The rank read through a helper (``get_tensor_model_parallel_rank()``)."""
    return _partial().chunk(dist.get_world_size(), 0)[_tp_rank()] * 2


def partial_halves_both_used() -> torch.Tensor:
    """Both pieces of a split by fixed indices (Megatron's fused cross entropy): a sum still."""
    halves = _partial().chunk(2, 0)
    return halves[0] + halves[1]


def _sharded() -> torch.Tensor:
    return sc.annotate(torch.randn(4, 6, generator=torch.Generator().manual_seed(3)), tp=sc.S(0))


def norm_with_the_replicated_term_weighted_by_the_first_rank() -> torch.Tensor:
    """Megatron's norm accounting as arithmetic: each rank's shard squared, the replicated
    term counted on the first rank only (weighted by ``float(rank == 0)``), summed over tp: right."""
    total = _sharded().pow(2).sum() + _replicated().pow(2).sum() * float(dist.get_rank() == 0)
    dist.all_reduce(total)
    return total


def norm_with_the_replicated_term_on_every_rank() -> torch.Tensor:
    """The same sum with the replicated term counted on every rank: a double count."""
    total = _sharded().pow(2).sum() + _replicated().pow(2).sum()
    dist.all_reduce(total)
    return total


def branch_decided_elsewhere() -> torch.Tensor:
    """The rank compared in another frame (a helper): the ops here are typed as usual."""
    first = _is_first()
    return _replicated() * (2 if first else 2)


def partial_after_a_branch() -> torch.Tensor:
    """Past the branch (a log line on the first rank) the rules hold again: the bug is reported."""
    p = sc.annotate(torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), tp=sc.P)
    if dist.get_rank() == 0:
        label = "first"
    else:
        label = "other"
    return torch.exp(p) if label else p


def _is_first() -> bool:
    return dist.get_rank(dist.group.WORLD) == 0


def _tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


PROGRAMS = [changed_on_first_rank, own_rows_by_branch, accumulated_on_first_rank_then_summed,
            accumulated_on_first_rank_then_scaled, accumulated_on_every_rank_then_scaled, rank_as_an_index, partial_chunk_by_rank, partial_chunk_by_a_rank_helper, partial_halves_both_used,
            branch_decided_elsewhere, partial_after_a_branch, norm_with_the_replicated_term_weighted_by_the_first_rank,
            norm_with_the_replicated_term_on_every_rank]


def _ranks() -> dict:
    results = {}
    for program in PROGRAMS:
        with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):
            value = program()
            results[program.__name__] = {"types": {a: repr(p) for a, p in sc.typeof(value).items()},
                                         "reports": [v.as_dict() for v in sc.violations()]}
        results["get_rank outside"] = type(dist.get_rank()).__name__
    return results


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_ranks, 2)


V, R, P, S0 = {"tp": "V"}, {"tp": "R"}, {"tp": "P"}, {"tp": "S(0)"}


@pytest.mark.parametrize(("program", "types"), [
    # the rank that skips the branch runs no op there: it cannot know (V and R: no claim)
    ("changed_on_first_rank", [V, R]),
    ("own_rows_by_branch", [S0, S0]),
    ("accumulated_on_first_rank_then_summed", [R, R]),
    ("accumulated_on_first_rank_then_scaled", [V, R]),  # the other rank scaled zeros
    ("accumulated_on_every_rank_then_scaled", [R, R]),
    ("rank_as_an_index", [S0, S0]),
    ("partial_chunk_by_rank", [V, V]),
    ("partial_chunk_by_a_rank_helper", [V, V]),
    ("partial_halves_both_used", [P, P]),
    ("branch_decided_elsewhere", [R, R]),
    ("norm_with_the_replicated_term_weighted_by_the_first_rank", [R, R]),
])
def test_types_after_a_branch_on_the_rank(ranks, program, types):
    """Each rank's type, and no report the ranks confirm together (a rank that accumulated
    alone cannot tell its sum from a double count: see sc.confirmed_across_ranks)."""
    assert [rank[program]["types"] for rank in ranks] == types
    assert sc.confirmed_across_ranks(rank[program]["reports"] for rank in ranks) == []


def test_a_rule_broken_past_the_branch_is_reported(ranks):
    confirmed = sc.confirmed_across_ranks(rank["partial_after_a_branch"]["reports"] for rank in ranks)
    assert [v["rule"] for v in confirmed] == ["non-linear on partial"]


def test_the_replicated_term_counted_on_every_rank_is_reported(ranks):
    confirmed = sc.confirmed_across_ranks(rank["norm_with_the_replicated_term_on_every_rank"]["reports"]
                                          for rank in ranks)
    assert [v["rule"] for v in confirmed] == ["affine on partial"], confirmed


def test_get_rank_is_itself_again_outside_the_region(ranks):
    assert [rank["get_rank outside"] for rank in ranks] == ["int", "int"]


def _call_and_subscript(fn) -> tuple[int, int]:
    """Offsets of ``fn``'s call of ``chunk`` and of its last subscript."""
    instructions = list(dis.get_instructions(fn))
    chunk = next(i for i, ins in enumerate(instructions) if ins.argval == "chunk")
    call = next(ins.offset for ins in instructions[chunk:] if ins.opname == "CALL")
    return call, [ins.offset for ins in instructions if ins.opname == "BINARY_SUBSCR"][-1]


def _picked(x, rank):
    return x.chunk(2)[rank()]


def _handed_on(x, rank):
    return tuple(x.chunk(2))[rank()]


def _added_to(x, y, rank):
    return (x.chunk(2) + y)[rank()]


def _stored(x, rank):
    pieces = x.chunk(2)
    return pieces[rank()]


@pytest.mark.parametrize(("fn", "picks"), [(_picked, True), (_handed_on, False), (_added_to, False),
                                           (_stored, False)])
def test_a_subscript_picks_a_pieces_only_straight_from_the_split(fn, picks):
    """The checker types a by-rank pick of a split's piece only where the subscript indexes
    the split's own result (a stored, handed-on or combined result may be another sequence)."""
    assert rank_branches.subscripts_result(fn.__code__, *_call_and_subscript(fn)) is picks
