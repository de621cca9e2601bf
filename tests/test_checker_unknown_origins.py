"""Coverage by site names where each unknown type began and why: an input that entered the
region untyped, an op no rule types, a rule that gave no type to its inputs' types."""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardcheck as sc
from shardcheck.typecheck.unknown_origins import AFTER, DECLINED, ENTERED, NO_RULE

_CACHE = torch.ones(4)  # a module-level buffer made before any region: it has no type


def test_each_unknown_is_traced_to_its_origin_with_its_cause():
    line = inspect.currentframe().f_lineno
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1]), sites=True):
        x = sc.annotate(torch.randn(4, 4), tp=sc.S(1))
        cached = (x * _CACHE).exp().sum()  # the cache has no type: 3 unknown calls
        inverse = torch.linalg.inv(x) * 2  # no rule
        shifted = x + 1  # typed: no origin
        assert sc.typeof(shifted) == {"tp": sc.S(1)}
        assert sc.typeof(cached) == {} and sc.typeof(inverse) == {}
    cov = sc.coverage()
    here = f"{__file__}:"
    origins = dict(cov.origins)
    [entered] = [o for o in origins if ENTERED in o]
    assert entered == f"{here}{line + 3} mul: input 1 (a tensor float32[4]) {ENTERED}"
    assert origins[entered] == 3
    [no_rule] = [o for o in origins if NO_RULE in o]
    assert no_rule.startswith(f"{here}{line + 4} linalg_inv_ex: {NO_RULE} aten.linalg_inv_ex")
    assert sum(origins.values()) == cov.unknown  # every unknown call has its origin
    # by the site of each call it reached: the cache's unknown reached line + 3 only
    assert {(loc, n) for o, loc, n in cov.reached if o == entered} == {(f"{here}{line + 3}", 3)}
    assert dict(cov.within(f"{here}{line + 3}").origins) == {entered: 3}


def test_a_rule_that_gives_no_type_is_named_with_its_inputs_types():
    """A convolution over a sequence cut across ranks has no placement (each rank's window
    misses its neighbour's edge): its rule declines, and the origin shows the input types."""
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1]), sites=True):
        x = sc.annotate(torch.randn(2, 3, 8), tp=sc.S(2))
        w = sc.annotate(torch.randn(4, 3, 3), tp=sc.R)
        assert sc.typeof(torch.nn.functional.conv1d(x, w)) == {}
    [(origin, calls)] = sc.coverage().origins
    assert origin.endswith(f"convolution: aten.convolution's rule {DECLINED} {{tp:S(2)}}, {{tp:R}}")
    assert calls == 1


def test_a_real_bug_next_to_an_unknown_is_still_flagged():
    """Tracing origins changes no verdict: a gelu of partial sums still raises."""
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1]), mode="collect", sites=True):
        partial = sc.annotate(torch.randn(4), tp=sc.P)
        torch.nn.functional.gelu(partial * _CACHE)  # unknown: not checked
        torch.nn.functional.gelu(partial)  # non-linear on partial
    assert [r.rule for r in sc.violations()] == ["non-linear on partial"]


def test_a_rank_slice_on_two_axes_alike_is_named_as_such():
    """dp and cp ranks [0, 2] and [0, 1]: rank 0's index is 0 on both, so the first half of a
    replicated tensor is its chunk on either; the rule cannot tell which group's rank chose it
    (Mamba's and GDN's cp slices of their parameters), and the origin says so."""
    with sc.typecheck(sc.Mesh(rank=0, cp=[0, 1], dp=[0, 2]), sites=True):
        weight = sc.annotate(torch.randn(8, 4), cp=sc.R, dp=sc.R)
        assert sc.typeof(weight[0:4].exp()) == {}
    cov = sc.coverage()
    [(origin, calls)] = cov.origins
    assert origin.endswith("slice: aten.slice [0:4] of dim 0 is this rank's chunk by its rank on cp and dp "
                           "alike: which group's rank chose it is not known")
    assert calls == 2 == cov.unknown and cov.typed == 1  # the randn: a slice knowing no axis is untyped


def test_sections_of_a_split_are_no_rank_chunk_of_two_axes():
    """A split into three sections at cp2-dp2: the first, a quarter of the dim at rank 0, is
    no chunk of the 4-rank dp x cp group (another number of parts): replicated like the others
    (GDN's conv weight split [16, 16, 32] lost its type there). A split into four equal parts
    still may be that group's chunk: unknown."""
    with sc.typecheck(sc.Mesh(rank=0, cp=[0, 1], dp=[0, 2])):
        weight = sc.annotate(torch.randn(64, 1, 4), cp=sc.R, dp=sc.R)
        assert [sc.typeof(p) for p in torch.split(weight, [16, 16, 32])] == [{"cp": sc.R, "dp": sc.R}] * 3
        quarters = torch.split(weight, 16)
        assert sc.typeof(quarters[0]) == {} and sc.typeof(quarters[1]) == {"cp": sc.R, "dp": sc.R}


@pytest.fixture
def cp_dp_groups():
    """Rank 0 of 4 (fake backend): cp over [0, 1], dp over [0, 2]; index 0 on both."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield dist.new_group([0, 1]), dist.new_group([0, 2])
    finally:
        dist.destroy_process_group()


def _local_chunk(param: torch.Tensor, group) -> torch.Tensor:
    """GDN's get_parameter_local_cp: this rank's rows, by the group's rank read as a number."""
    rank = group.rank()
    rows = [slice(None)] * param.dim()
    rows[0] = slice(rank * param.shape[0] // group.size(), (rank + 1) * param.shape[0] // group.size())
    return param[tuple(rows)]


def test_a_rank_slice_is_the_chunk_of_the_group_whose_rank_computed_its_bounds(cp_dp_groups):
    """At a rank whose cp and dp indices agree, the bounds computed from ``cp.rank()`` say
    which: S(0) on cp (correct), on dp when cut by the dp rank; a fixed slice stays unknown.
    The wrong group's chunk added to a cp chunk is still flagged."""
    cp, dp = cp_dp_groups
    with sc.typecheck(sc.Mesh(cp=cp, dp=dp), mode="collect"):
        weight = sc.annotate(torch.randn(8, 4), cp=sc.R, dp=sc.R)
        by_cp, by_dp = _local_chunk(weight, cp), _local_chunk(weight, dp)
        assert sc.typeof(by_cp) == {"cp": sc.S(0), "dp": sc.R}
        assert sc.typeof(by_dp) == {"cp": sc.R, "dp": sc.S(0)}
        assert sc.typeof(weight[0:4]) == {}
        by_cp + by_dp  # rows of another rank on each axis: a bug
    assert sc.violations(), "the mixed chunks were not flagged"
    assert type(cp.rank()) is int  # itself again outside the region


def test_numbers_from_a_rank_remember_its_axes_and_stay_ints():
    """A rank read (get_rank's RankNumber) and what arithmetic makes of it keep the axes, hash
    and compare as the int they are, and pickle as plain ints."""
    import pickle

    from shardcheck.typecheck.rank_branches import RankDerived, RankNumber

    rank = RankNumber(1, None, (0,))
    start = (rank + 1) * 8 // 2
    assert type(start) is RankDerived and start == 8 and start.axes == (0,)
    assert (RankDerived(2, (1,)) * rank).axes == (0, 1)
    assert {rank: "a", start: "b"} == {1: "a", 8: "b"}
    assert type(pickle.loads(pickle.dumps(start))) is int


def test_an_unknown_after_a_reported_violation_names_it(cp_dp_groups):
    """A gather on a group that is no mesh axis (LLaVA's scatter on the global tp group under
    explicit groups): reported, and the unknown it leaves begins at that line, following the
    violation (its ops run inside torch.distributed, whose frames are no site)."""
    cp, dp = cp_dp_groups
    other = dist.new_group([0, 3])
    line = inspect.currentframe().f_lineno
    with sc.typecheck(sc.Mesh(cp=cp, dp=dp), mode="collect", sites=True):
        x = sc.annotate(torch.randn(4, 4), cp=sc.S(0), dp=sc.R)
        gathered = torch.empty(8, 4)
        dist.all_gather_into_tensor(gathered, x, group=other)
        (gathered * 2).sum()
    assert [r.rule for r in sc.violations()] == ["unknown axis"]
    [(origin, calls)] = sc.coverage().origins
    assert origin == (f"{__file__}:{line + 4} _allgather_base: c10d._allgather_base_ {AFTER} "
                      "(unknown axis) reported there") and calls == 2


def test_an_unknown_sent_through_an_all_to_all_keeps_its_origin(cp_dp_groups):
    """``all_to_all_single`` writes its output and returns only its work: the output of an
    unknown input keeps the input's origin (GDN's head permutation cached by an earlier
    region: the unknown began at the permutation, not at the reshape after the exchange)."""
    cp, dp = cp_dp_groups
    line = inspect.currentframe().f_lineno
    with sc.typecheck(sc.Mesh(cp=cp, dp=dp), mode="collect", sites=True):
        x = sc.annotate(torch.randn(4, 4), cp=sc.S(0), dp=sc.R)
        sent = x * _CACHE
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=cp)
        (received * 2).sum()
    cov = sc.coverage()
    [(origin, calls)] = cov.origins
    assert origin == f"{__file__}:{line + 3} mul: input 1 (a tensor float32[4]) {ENTERED}"
    assert calls == 3  # the mul, and the two after the exchange (torch.distributed's frames: no site)
    assert (origin, f"{__file__}:{line + 6}", 2) in cov.reached
