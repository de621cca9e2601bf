"""The issue's programs on real Gloo ranks (2 and 4 processes), correct and buggy variants."""

import pytest
import spmd_programs as prog
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks


def _outcome(program, mesh, *groups):
    """('ok', value, types) or ('error', rule, location, first line), picklable.

    Values travel as lists: a tensor sent through the result queue would be shared memory
    that the parent can no longer open once the rank has exited.
    """
    with sc.typecheck(mesh):
        try:
            value = program(*groups)
        except sc.SpmdTypeError as err:
            return ("error", err.rule, err.location, str(err).splitlines()[0])
        types = {k: repr(v) for k, v in sc.typeof(value).items()}
    return ("ok", value.tolist(), types)


def _collect(group):
    """Collect mode: the buggy program twice, deduplicated to one record."""
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        for _ in range(2):
            prog.gelu_before_all_reduce(group)
    return [(r.rule, r.location) for r in sc.violations()]


def _collected(program, group):
    """Collect mode: the program's violation records, as every rank sends them."""
    with sc.typecheck(sc.Mesh(dp=group), mode="collect"):
        program(group)
    return [v.as_dict() for v in sc.violations()]


def _rank_slices():
    world = dist.group.WORLD
    return {name: _collected(getattr(prog, name), world)
            for name in ("varying_blocks_by_layer", "varying_block_by_rank")}


def test_a_fixed_index_into_varying_blocks_is_not_a_rank_slice():
    """Each rank's rank-slice heuristic fires once (rank 0 at block 0, rank 1 at block 1): told
    apart from slicing by rank, where every rank cuts its own piece at the same op."""
    per_rank = spawn_ranks(_rank_slices, 2)
    by_layer = [rank["varying_blocks_by_layer"] for rank in per_rank]
    assert [len(rank) for rank in by_layer] == [1, 1]
    assert by_layer[0][0]["occurrence"] != by_layer[1][0]["occurrence"]
    assert sc.confirmed_across_ranks(by_layer) == []
    [bug] = sc.confirmed_across_ranks(rank["varying_block_by_rank"] for rank in per_rank)
    assert bug["rule"] == "split of varying" and bug["axis"] == "dp"
    assert bug["location"].endswith("spmd_programs.py:" + str(_line_of(prog.varying_block_by_rank, "BUG")))


def _line_of(function, marker: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if marker in line)


def _two_ranks():
    world = dist.group.WORLD
    tp, cp = sc.Mesh(tp=world), sc.Mesh(cp=world)
    results = {name: _outcome(getattr(prog, name), tp, world) for name in (
        "mlp", "mlp_sequence_parallel", "gelu_before_all_reduce", "all_reduce_twice",
        "label_smoothing_mean_over_shard", "label_smoothing_summed", "bias_not_sharded",
        "bias_sliced_by_rank")}
    for name in ("cp_loss_divided_locally", "cp_loss_sum_then_divide"):
        results[name] = _outcome(getattr(prog, name), cp, world)
    results["collect"] = _collect(world)
    return results


def _four_ranks():
    """tp over [0, 2] and [1, 3] (explicit groups); the global tp groups are [0, 1], [2, 3]."""
    tp = [dist.new_group(r) for r in ([0, 2], [1, 3])][dist.get_rank() % 2]
    global_tp = [dist.new_group(r) for r in ([0, 1], [2, 3])][dist.get_rank() // 2]
    world = dist.group.WORLD
    results = {
        "mlp": _outcome(prog.mlp, sc.Mesh(tp=world), world),
        "mlp_sequence_parallel": _outcome(prog.mlp_sequence_parallel, sc.Mesh(tp=world), world),
        "gelu_before_all_reduce": _outcome(prog.gelu_before_all_reduce, sc.Mesh(tp=world), world),
        "gather_on_the_data_group": _outcome(prog.gather_on_the_data_group, sc.Mesh(tp=tp), tp),
        "gather_on_the_global_group": _outcome(prog.gather_on_the_global_group, sc.Mesh(tp=tp),
                                               tp, global_tp),
    }
    mesh = sc.Mesh(tp=tp, dp=global_tp)
    results["scatter_by_own_rank"] = _outcome(prog.scatter_by_wrong_rank, mesh, tp)
    results["scatter_by_wrong_rank"] = _outcome(prog.scatter_by_wrong_rank, mesh, global_tp)
    cp, pp = global_tp, tp  # cp over [0, 1] and [2, 3]; pp over [0, 2] and [1, 3]
    for name, twice in (("token_count", False), ("token_count_counted_twice", True)):
        results[name] = _outcome(lambda c, p, t=twice: prog.token_count_from_the_last_stage(c, p, t),
                                 sc.Mesh(cp=cp, pp=pp), cp, pp)
    return results


@pytest.fixture(scope="module")
def two():
    return spawn_ranks(_two_ranks, 2)


@pytest.fixture(scope="module")
def four():
    return spawn_ranks(_four_ranks, 4)


def _ok(results, name, types):
    for rank in results:
        kind, value, got = rank[name]
        assert kind == "ok" and got == types, (name, rank[name])
    return [torch.tensor(rank[name][1]) for rank in results]


def _error(results, name, rule, ranks=None):
    for r, rank in enumerate(results):
        if ranks is not None and r not in ranks:
            assert rank[name][0] == "ok", (r, rank[name])
            continue
        assert rank[name][:3] == ("error", rule, prog.marker_line(rule)), rank[name]
        assert rank[name][3].startswith(f"checker: {rule} at {prog.marker_line(rule)} in ")


@pytest.mark.slow
def test_mlp_correct_on_two_and_four_ranks(two, four):
    for results in (two, four):
        for value in _ok(results, "mlp", {"tp": "R"}):
            torch.testing.assert_close(value, prog.reference_mlp())


@pytest.mark.slow
def test_sequence_parallel_mlp_correct(two, four):
    for results in (two, four):
        values = _ok(results, "mlp_sequence_parallel", {"tp": "S(0)"})
        torch.testing.assert_close(torch.cat(values), prog.reference_mlp())


@pytest.mark.slow
def test_gelu_before_all_reduce_is_non_linear_on_partial(two, four):
    _error(two, "gelu_before_all_reduce", "non-linear on partial")
    _error(four, "gelu_before_all_reduce", "non-linear on partial")


@pytest.mark.slow
def test_all_reduce_of_reduced_value_is_double_count(two):
    _error(two, "all_reduce_twice", "double count")


@pytest.mark.slow
def test_context_parallel_loss(two):
    _error(two, "cp_loss_divided_locally", "division by partial")
    values = _ok(two, "cp_loss_sum_then_divide", {"cp": "R"})
    assert values[0] == values[1]


@pytest.mark.slow
def test_vocab_parallel_label_smoothing(two):
    _error(two, "label_smoothing_mean_over_shard", "mean over shard")
    _ok(two, "label_smoothing_summed", {"tp": "R"})


@pytest.mark.slow
def test_replicated_bias_on_sharded_output(two):
    # On rank 0 the first chunk is its own chunk, so only rank 1 can tell.
    _error(two, "bias_not_sharded", "global shape mismatch", ranks={1})
    _ok(two, "bias_sliced_by_rank", {"tp": "S(1)"})


@pytest.mark.slow
def test_gather_on_a_group_over_other_ranks(four):
    _error(four, "gather_on_the_global_group", "unknown axis")
    _ok(four, "gather_on_the_data_group", {"tp": "R"})


@pytest.mark.slow
def test_scatter_indexed_by_another_groups_rank(four):
    # Ranks 0 and 3 have the same index in both groups, so only 1 and 2 can tell.
    _error(four, "scatter_by_wrong_rank", "split of varying", ranks={1, 2})
    _ok(four, "scatter_by_own_rank", {"tp": "S(1)", "dp": "V"})


@pytest.mark.slow
def test_a_broadcast_gives_every_rank_the_roots_type(four):
    """The first pipeline stage's zeros take the last stage's count and its type (a partial sum
    over cp): summed over cp it is the global count, as on one rank. Summed over cp twice, every
    rank is told, the stages that only received the count too."""
    counts = _ok(four, "token_count", {"cp": "R", "pp": "R"})
    assert [c.item() for c in counts] == [2 * 4 - 3] * 4  # the one-rank count: 8 tokens, 3 padding
    line = f"{prog.__file__}:{_line_of(prog.token_count_from_the_last_stage, 'BUG')}"
    for rank in four:
        assert rank["token_count_counted_twice"][:3] == ("error", "double count", line), rank


@pytest.mark.slow
def test_collect_mode_records_each_violation_once(two):
    for records in (rank["collect"] for rank in two):
        assert records == [("non-linear on partial", prog.marker_line("non-linear on partial"))]
