"""Coverage by site names where each unknown type began and why: an input that entered the
region untyped, an op no rule types, a rule that gave no type to its inputs' types."""

import inspect

import torch

import shardcheck as sc
from shardcheck.typecheck.unknown_origins import DECLINED, ENTERED, NO_RULE

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
