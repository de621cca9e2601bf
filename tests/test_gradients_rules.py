"""Every row of the gradient-type table and of the norm-accounting check, without ranks."""

import pytest

from shardcheck.typecheck.gradient_rules import MISDECLARED, MISMATCH, UNREDUCED, gradient_finding
from shardcheck.typecheck.norm_accounting import Counted, accounting_errors
from shardcheck.typecheck.types import I, P, R, S, V


@pytest.mark.parametrize(("param", "grad", "loss_varies", "rule"), [
    (R, R, False, None),
    (I, R, False, None),
    (S(0), S(0), False, None),
    (R, P, False, UNREDUCED),
    (S(1), P, False, UNREDUCED),
    (R, V, True, UNREDUCED),
    (R, V, False, MISDECLARED),
    (R, S(0), False, MISDECLARED),
    (S(0), S(1), False, MISMATCH),
    (S(0), R, False, MISMATCH),
    (S(0), V, False, MISMATCH),
    (S(0), V, True, UNREDUCED),
    (None, P, False, None),
    (R, None, False, None),
    (V, P, False, None),
])
def test_gradient_type_table(param, grad, loss_varies, rule):
    found = gradient_finding("w", "tp", param, grad, loss_varies)
    assert (found and found.rule) == rule
    if found:
        assert found.param == "w" and found.axis == "tp" and "tp" in found.fix


@pytest.mark.parametrize(("param", "grad", "rule"), [
    (S(0), R, None), (R, S(0), None), (R, P, UNREDUCED), (S(0), V, MISMATCH)])
def test_constant_gradients_fit_any_layout_but_not_a_partial(param, grad, rule):
    found = gradient_finding("w", "tp", param, grad, False, grad_constant=True)
    assert (found and found.rule) == rule


def test_misdeclared_fix_names_the_shard_dim():
    found = gradient_finding("head_scale", "tp", R, S(0), False)
    assert "declare head_scale S(0) on tp" in found.fix


def _ranks(*counted):
    return [Counted((coord,), params) for coord, params in enumerate(counted)]


def test_accounting_accepts_megatron_filter():
    sharded, replicated = {"fc1.weight": ("S",)}, {"norm.weight": ("R",)}
    ranks = _ranks({**sharded, **replicated}, sharded, sharded, sharded)
    assert accounting_errors(ranks, ["tp"], [4]) == []


def test_accounting_flags_sharded_parameter_left_out():
    ranks = _ranks({"head_scale": ("S",)}, {})
    (error,) = accounting_errors(ranks, ["tp"], [2])
    assert (error.param, error.axis) == ("head_scale", "tp")
    assert "only tp ranks [0] count it" in error.message


def test_accounting_flags_replicated_parameter_counted_twice():
    ranks = _ranks({"norm.weight": ("R",)}, {"norm.weight": ("R",)})
    (error,) = accounting_errors(ranks, ["tp"], [2])
    assert error.param == "norm.weight" and "tp ranks [0, 1] all count it" in error.message


def test_accounting_over_two_axes():
    # tp x cp = 2 x 2, coords (tp, cp): R on tp, S on cp: one tp rank per cp rank.
    grid = [(0, 0), (1, 0), (0, 1), (1, 1)]
    good = [Counted(c, {"w": ("R", "S")} if c[0] == 0 else {}) for c in grid]
    assert accounting_errors(good, ["tp", "cp"], [2, 2]) == []
    bad = [Counted(c, {"w": ("R", "S")} if c == (0, 0) else {}) for c in grid]
    (error,) = accounting_errors(bad, ["tp", "cp"], [2, 2])
    assert error.axis == "cp"
