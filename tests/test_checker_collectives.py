"""Collective rules, driven through torch.distributed on a fake process group (one process)."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardcheck as sc
from shardcheck.typecheck.types import PAVG, PEVEN, SectionShard

R, P, V, S = sc.R, sc.P, sc.V, sc.S
SUM, AVG, MAX = dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX


@pytest.fixture(scope="module")
def groups():
    """Rank 0 of 4 on a fake backend: tp = [0, 1], dp = [0, 2], and a group over [0, 3]."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield {"tp": dist.new_group([0, 1]), "dp": dist.new_group([0, 2]),
               "other": dist.new_group([0, 3]), "world": dist.group.WORLD}
    finally:
        dist.destroy_process_group()


def check(groups, program):
    """Run program(groups) typed on the tp x dp mesh; its result's tp type or the rule broken."""
    with sc.typecheck(sc.Mesh(tp=groups["tp"], dp=groups["dp"])):
        try:
            return sc.typeof(program(groups)).get("tp")
        except sc.SpmdTypeError as err:
            return err.rule


def T(*shape, tp=R, dp=R):  # noqa: N802
    return sc.annotate(torch.randn(*shape), tp=tp, dp=dp)


def keep(x, action):
    """Run ``action`` (on x when it takes an argument) and return x."""
    action(x) if action.__code__.co_argcount else action()
    return x


def count():
    """Tokens per expert on this rank: a sum over the rank's rows of a routing map."""
    routing = sc.annotate(torch.eye(4, dtype=torch.bool).repeat(2, 1), tp=S(0), dp=R)
    return routing.sum(dim=0).long()


def all_reduce(x, g, op=SUM):
    dist.all_reduce(x, op=op, group=g["tp"])
    return x


def gather_list(x, g):
    out = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(out, x, group=g["tp"])
    return torch.cat(out)


def gather_into(x, g):
    out = torch.empty(x.shape[0] * 2, *x.shape[1:])
    dist.all_gather_into_tensor(out, x, group=g["tp"])
    return out


def gather_last_dim(x, g):
    """Megatron's gather along the last dim: gather on dim 0, chunk, cat on the last dim."""
    return torch.cat(gather_into(x, g).chunk(2, dim=0), dim=-1)


def reduce_scatter(x, g, op=SUM):
    out = torch.empty(x.shape[0] // 2, *x.shape[1:])
    dist.reduce_scatter_tensor(out, x, op=op, group=g["tp"])
    return out


def reduce_scatter_list(x, g):
    out = torch.empty(x.shape[0] // 2, *x.shape[1:])
    dist.reduce_scatter(out, list(x.chunk(2)), group=g["tp"])
    return out


def reduce_scatter_cols(x, g):
    out = torch.empty(x.shape[0], x.shape[1] // 2)
    dist.reduce_scatter(out, list(x.chunk(2, dim=1)), group=g["tp"])
    return out


def reduce_scatter_copies(x, g):
    """Contiguous copies of the chunks: where they came from is not known (untyped)."""
    out = torch.empty(x.shape[0], x.shape[1] // 2)
    dist.reduce_scatter(out, [c.contiguous() for c in x.chunk(2, dim=1)], group=g["tp"])
    return out


def all_to_all(x, g):
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=g["tp"])
    return out


def hp2sp(x, g, order=(0, 1), dim=1, axis="tp", splits=None):
    """Megatron's all_to_all_hp2sp: all-to-all, then its dim-0 blocks joined along ``dim``."""
    out = torch.empty(sum(splits) if splits else x.shape[0], *x.shape[1:])
    dist.all_to_all_single(out, x, output_split_sizes=splits, input_split_sizes=splits, group=g[axis])
    blocks = out.split(out.shape[0] // 2, dim=0)
    return torch.cat([blocks[i] for i in order], dim=dim)


def hp2sp_list(x, g, order=(0, 1), copies=False):
    """hp2sp in the list form: the dim-0 chunks sent, the blocks received joined along dim 1."""
    pieces = [c.clone() if copies else c for c in x.chunk(2)]
    outs = [torch.empty_like(p) for p in pieces]
    dist.all_to_all(outs, pieces, group=g["tp"])
    return torch.cat([outs[i] for i in order], dim=1)


def all_to_all_list(x, g):
    outs = [torch.empty(2), torch.empty(2)]
    dist.all_to_all(outs, list(x.chunk(2)), group=g["tp"])
    return outs[0]


def broadcast(x, g):
    dist.broadcast(x, src=0, group=g["tp"])
    return x


ROWS = [
    ("all_reduce SUM of P", lambda g: all_reduce(T(4, tp=P), g), R),
    ("all_reduce SUM of V", lambda g: all_reduce(T(4, tp=V), g), R),
    ("all_reduce SUM of R", lambda g: all_reduce(T(4), g), "double count"),
    # each rank holds the sum over n: a partial sum of equal shares (numbers: test_collective_table)
    ("all_reduce AVG of P", lambda g: all_reduce(T(4, tp=P), g, AVG), PEVEN),
    ("all_reduce AVG of V", lambda g: all_reduce(T(4, tp=V), g, AVG), R),
    ("all_reduce AVG of a shard mean", lambda g: all_reduce(T(4, 2, tp=S(1)).mean(1), g, AVG), R),
    ("all_reduce SUM of a shard mean", lambda g: all_reduce(T(4, 2, tp=S(1)).mean(1), g),
     "mean over shard"),
    ("all_reduce MAX of R", lambda g: all_reduce(T(4), g, MAX), R),
    ("all_reduce MAX of V", lambda g: all_reduce(T(4, 2, tp=S(1)).amax(1), g, MAX), R),
    ("all_reduce MAX of P", lambda g: all_reduce(T(4, tp=P), g, MAX), "non-linear on partial"),
    ("all_gather list of S(0)", lambda g: gather_list(T(4, tp=S(0)), g), R),
    ("all_gather list of V", lambda g: gather_list(T(4, tp=V), g), R),
    ("all_gather list of R", lambda g: gather_list(T(4), g), "gather of replicated"),
    ("all_gather_into_tensor of S(0)", lambda g: gather_into(T(4, 3, tp=S(0)), g), R),
    ("all_gather_into_tensor of V", lambda g: gather_into(T(4, tp=V), g), R),
    ("all_gather_into_tensor of R", lambda g: gather_into(T(4), g), "gather of replicated"),
    # a partial count's pieces, stacked: every rank's count, summed over the blocks = the total
    ("all_gather list of a partial count", lambda g: gather_list(count(), g), R),
    ("all_gather_into_tensor of a partial count", lambda g: gather_into(count(), g), R),
    ("functional all_gather of a partial count",
     lambda g: fc.all_gather_tensor(count(), 0, g["tp"]) * 1, R),
    ("all_gather_into_tensor of a count summed over tp first",
     lambda g: gather_into(all_reduce(count(), g), g), "gather of replicated"),
    ("all_gather_into_tensor of a float partial", lambda g: gather_into(T(4, tp=P), g), None),
    ("gather along the last dim", lambda g: gather_last_dim(T(4, 3, tp=S(1)), g), R),
    ("reduce_scatter_tensor of P", lambda g: reduce_scatter(T(4, 3, tp=P), g), S(0)),
    ("reduce_scatter_tensor of V", lambda g: reduce_scatter(T(4, 3, tp=V), g), S(0)),
    ("reduce_scatter_tensor of R", lambda g: reduce_scatter(T(4, 3), g), "scatter of replicated"),
    ("reduce_scatter list of P", lambda g: reduce_scatter_list(T(4, tp=P, dp=V), g), S(0)),
    ("reduce_scatter list of R", lambda g: reduce_scatter_list(T(4, dp=V), g),
     "scatter of replicated"),
    ("all_to_all_single", lambda g: all_to_all(T(4, tp=S(0)), g), V),
    ("broadcast of P", lambda g: broadcast(T(4, tp=P), g), "broadcast of partial"),
    ("broadcast of S(0)", lambda g: broadcast(T(4, tp=S(0)), g), V),
    ("all_reduce PRODUCT of R", lambda g: all_reduce(T(4), g, dist.ReduceOp.PRODUCT), "double count"),
    ("reduce_scatter list along dim 1", lambda g: reduce_scatter_cols(T(4, 4, tp=P), g), S(1)),
    ("reduce_scatter list of copies", lambda g: reduce_scatter_copies(T(4, 4, tp=P), g), None),
    ("all_to_all list", lambda g: all_to_all_list(T(4, tp=V), g), V),
    ("hp2sp: the exchanged blocks of S(1) joined along dim 1", lambda g: hp2sp(T(4, 4, tp=S(1)), g), S(0)),
    ("hp2sp of S(-1)", lambda g: hp2sp(T(4, 2, 4, tp=S(-1)), g, dim=-1), S(0)),
    ("hp2sp joined in reverse order", lambda g: hp2sp(T(4, 4, tp=S(1)), g, order=(1, 0)), V),
    ("hp2sp joined along another dim than the shard's",
     lambda g: hp2sp(T(4, 2, 4, tp=S(2)), g, dim=1), V),
    ("hp2sp of a row shard", lambda g: hp2sp(T(4, 4, tp=S(0)), g), V),
    ("hp2sp, list form", lambda g: hp2sp_list(T(4, 4, tp=S(1)), g), S(0)),
    ("hp2sp, list form, joined in reverse order", lambda g: hp2sp_list(T(4, 4, tp=S(1)), g, order=(1, 0)), V),
    ("hp2sp, list form, of copies of the chunks", lambda g: hp2sp_list(T(4, 4, tp=S(1)), g, copies=True), V),
    ("hp2sp, list form, of a row shard", lambda g: hp2sp_list(T(4, 4, tp=S(0)), g), V),
    ("hp2sp with uneven splits", lambda g: hp2sp(T(4, 4, tp=S(1)), g, splits=[1, 3]), V),
    ("broadcast", lambda g: broadcast(T(4, tp=V), g), R),
    ("functional broadcast", lambda g: fc.broadcast(T(4, tp=V), 0, g["tp"]) * 1, R),
    ("barrier keeps types", lambda g: keep(T(4, tp=P), lambda: dist.barrier(group=g["tp"])), P),
    ("send keeps types", lambda g: keep(T(4, tp=P), lambda x: dist.send(x, dst=1)), P),
    ("recv gives V", lambda g: keep(T(4, tp=R), lambda x: dist.recv(x, src=1)), V),
    ("unknown axis", lambda g: dist.all_reduce(T(4, tp=P), group=g["other"]), "unknown axis"),
    ("functional all_reduce", lambda g: fc.all_reduce(T(4, tp=P), "sum", g["tp"]) * 1, R),
    ("functional all_reduce of R", lambda g: fc.all_reduce(T(4), "sum", g["tp"]) * 1,
     "double count"),
    ("functional all_gather", lambda g: fc.all_gather_tensor(T(4, 3, tp=S(1)), 1, g["tp"]) * 1, R),
    ("functional reduce_scatter",
     lambda g: fc.reduce_scatter_tensor(T(4, 3, tp=P), "sum", 0, g["tp"]) * 1, S(0)),
    ("functional all_to_all",
     lambda g: fc.all_to_all_single(T(4, tp=V), None, None, g["tp"]) * 1, V),
]


@pytest.mark.parametrize(("program", "expected"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_collective_rule(groups, program, expected):
    assert check(groups, program) == expected


@pytest.mark.parametrize(("axis", "tp", "dp", "expected"), [
    ("dp", S(1), R, {"tp": SectionShard(1, (8, 8)), "dp": V}),  # the dp blocks are copies
    ("tp", S(1), S(0), {"tp": S(0), "dp": S(0)}),  # tp's row blocks inside dp's rows
    ("dp", S(0), S(1), {"tp": S(0), "dp": V}),  # dp's row blocks would sit inside tp's
    ("tp", S(1), S(1), {"tp": S(0), "dp": S(1)}),  # dp's columns, outside tp's, kept
    ("dp", S(1), S(1), {"tp": V, "dp": S(0)}),  # tp's columns, inside dp's, joined in dp's order
])
def test_hp2sp_with_another_axis_sharding_a_dim(groups, axis, tp, dp, expected):
    """On a tp x dp mesh (tp inner): an axis outside the group keeps its shard of the rows or
    of the columns only where its pieces nest as the mesh's order says."""
    with sc.typecheck(sc.Mesh(tp=groups["tp"], dp=groups["dp"]), mode="collect"):
        assert sc.typeof(hp2sp(T(8, 8, tp=tp, dp=dp), groups, axis=axis)) == expected


def test_group_over_several_axes_reduces_each(groups):
    with sc.typecheck(sc.Mesh(tp=groups["tp"], dp=groups["dp"])):
        x = T(4, tp=P, dp=V)
        dist.all_reduce(x, group=groups["world"])
        assert sc.typeof(x) == {"tp": R, "dp": R}


def test_unknown_axis_message_names_ranks_and_axes(groups):
    with sc.typecheck(sc.Mesh(tp=groups["tp"], dp=groups["dp"])):
        with pytest.raises(sc.SpmdTypeError) as info:
            dist.all_reduce(T(4, tp=P), group=groups["other"])
    assert "the group has ranks [0, 3]; the mesh has tp=[0, 1], dp=[0, 2]" in str(info.value)


def test_inplace_all_reduce_retypes_views_of_a_flat_buffer(groups):
    with sc.typecheck(sc.Mesh(tp=groups["tp"], dp=groups["dp"])):
        flat = torch.zeros(10)
        a, b = flat[:4].view(2, 2), flat[4:].view(3, 2)
        a.add_(T(2, 2, tp=P, dp=V))
        b.add_(T(3, 2, tp=P, dp=V))
        dist.all_reduce(flat, group=groups["world"])
        assert sc.typeof(a) == {"tp": R, "dp": R} and sc.typeof(b) == {"tp": R, "dp": R}


def test_untyped_collective_stays_unknown(groups):
    with sc.typecheck(sc.Mesh(tp=groups["tp"], dp=groups["dp"])):
        x = torch.ones(2) + torch.randn(2).detach().requires_grad_(False).abs().neg_()
        y = sc.annotate(torch.ones(2), tp=R)
        y.copy_(x._neg_view())  # unknown source: y becomes unknown
        dist.all_reduce(y, group=groups["other"])  # untyped: no violation even on a wrong group
        assert sc.typeof(y) == {}


def test_mean_over_shard_reads_as_partial_average(groups):
    with sc.typecheck(sc.Mesh(tp=groups["tp"], dp=groups["dp"])):
        assert sc.typeof(T(4, 2, tp=S(1)).mean(1))["tp"] is PAVG


def test_mesh_from_a_named_device_mesh(groups):
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with sc.typecheck(sc.Mesh.from_device_mesh(device_mesh)):
        x = T(4, tp=P, dp=V)
        dist.all_reduce(x, group=device_mesh.get_group("tp"))
        assert sc.typeof(x) == {"tp": R, "dp": V}
        dist.all_reduce(x, group=device_mesh.get_group("dp"))
        assert sc.typeof(x) == {"tp": R, "dp": R}


@pytest.mark.parametrize("tp, expected", [(S(0), P), (R, R), (P, "non-linear on partial")])
def test_count_nonzero_of_shards_adds_up_and_of_a_partial_sum_is_no_count(groups, tp, expected):
    assert check(groups, lambda g: torch.count_nonzero(T(4, 2, tp=tp))) == expected


@pytest.mark.parametrize("strides, expected", [((4, 1), S(0)), ((1, 2), None)])
def test_as_strided_reading_a_contiguous_tensor_whole_as_another_shape_is_a_view(groups, strides, expected):
    """Autograd cuts the gradient of an in-place op on a view of a flat buffer so; a
    transposing as_strided is no view of the same layout and stays unknown."""
    assert check(groups, lambda g: T(8, tp=S(0)).as_strided((2, 4), strides)) == expected


def test_a_cut_by_the_rank_of_a_group_over_two_axes_is_no_replica(groups):
    """Rank 0's quarter of a tensor replicated over tp and dp is its piece by its rank in the
    tp x dp group (Megatron's local experts, by the tp x ep rank): not a replica on either
    axis, and no per-axis shard either, so unknown; another fixed piece stays replicated."""
    with sc.typecheck(sc.Mesh(tp=groups["tp"], dp=groups["dp"]), mode="collect"):
        x = T(8, 4)
        assert sc.typeof(x[0:2]) == {}
        assert sc.typeof(x[2:4]) == {"tp": R, "dp": R}
