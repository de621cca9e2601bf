"""The seed of loss.backward() and check_gradients' API, on one rank of a fake 4-rank group.

tp = [0, 1], dp = [0, 2]. The fake backend types collectives without moving data, which is all
these tests need: they look at types, not values.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardcheck as sc

R, P, V, S = sc.R, sc.P, sc.V, sc.S


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield sc.Mesh(tp=dist.new_group([0, 1]), dp=dist.new_group([0, 2]))
    finally:
        dist.destroy_process_group()


def linear_step(mesh, x_types, mode="collect"):
    """A bias-free linear layer, replicated on both axes, on an input of the given types."""
    model = nn.Linear(4, 3, bias=False)
    with sc.typecheck(mesh, mode=mode):
        sc.annotate_parameters(model, tp=R, dp=R)
        loss = model(sc.annotate(torch.randn(8, 4), **x_types)).sum()
        loss_type = sc.typeof(loss)
        loss.backward()
        grad_type = sc.typeof(model.weight.grad)
        findings = [(f.rule, f.axis) for f in sc.check_gradients(model)]
    return loss_type, grad_type, findings, model


def test_replicated_loss_gives_replicated_gradients(mesh):
    loss, grad, findings, _ = linear_step(mesh, {"tp": R, "dp": R})
    assert loss == {"tp": R, "dp": R} and grad == {"tp": R, "dp": R} and findings == []


def test_partial_loss_has_sum_semantics(mesh):
    # Each tp rank holds a slice of the tokens: the loss is the sum of the ranks' losses, so
    # each rank's gradient is its contribution to the sum: P, to be all-reduced over tp.
    loss, grad, findings, _ = linear_step(mesh, {"tp": S(0), "dp": R})
    assert loss["tp"] is P and grad["tp"] is P
    assert findings == [("unreduced gradient", "tp")]


def test_varying_loss_over_dp_has_ddp_semantics(mesh):
    # Each dp rank has its own batch: its gradient is V, a contribution that DDP's all-reduce
    # sums or averages. Missing that all-reduce is an unreduced gradient, not a misdeclaration.
    loss, grad, findings, _ = linear_step(mesh, {"tp": R, "dp": V})
    assert loss["dp"] is V and grad["dp"] is V
    assert findings == [("unreduced gradient", "dp")]


@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG])
def test_dp_all_reduce_completes_the_gradient(mesh, op):
    model = nn.Linear(4, 3, bias=False)
    with sc.typecheck(mesh):
        sc.annotate_parameters(model, tp=R, dp=R)
        model(sc.annotate(torch.randn(8, 4), tp=R, dp=V)).sum().backward()
        dist.all_reduce(model.weight.grad, op=op, group=mesh.groups["dp"])
        assert sc.typeof(model.weight.grad) == {"tp": R, "dp": R}
        assert sc.check_gradients(model) == []


def test_varying_gradient_without_varying_loss_is_a_misdeclared_parameter(mesh):
    model = nn.Linear(4, 3, bias=False)
    with sc.typecheck(mesh, mode="collect"):
        sc.annotate_parameters(model, tp=R)
        model(sc.annotate(torch.randn(8, 4), tp=R)).sum().backward()
        sc.annotate(model.weight.grad, tp=V)  # as if each rank computed its own gradient
        assert [(f.rule, f.param) for f in sc.check_gradients(model)] == [
            ("misdeclared parameter", "weight")]


def test_optimizer_step_raises_in_raise_mode(mesh):
    model = nn.Linear(4, 3, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with sc.typecheck(mesh):
        sc.annotate_parameters(model, tp=R, dp=R)
        model(sc.annotate(torch.randn(8, 4), tp=S(0), dp=R)).sum().backward()
        with pytest.raises(sc.SpmdTypeError) as info:
            optimizer.step()
    first = str(info.value).splitlines()[0]
    assert first.startswith("checker: unreduced gradient at ")
    assert __file__ in first and first.endswith("in optimizer.step: weight: parameter R on tp, gradient P")
    assert info.value.rule == "unreduced gradient"


def test_optimizer_step_outside_a_region_is_not_checked(mesh):
    model = nn.Linear(4, 3, bias=False)
    with sc.typecheck(mesh):  # a region whose step would raise: an unreduced P gradient
        sc.annotate_parameters(model, tp=R, dp=R)
        model(sc.annotate(torch.randn(8, 4), tp=S(0), dp=R)).sum().backward()
    before, grad = model.weight.detach().clone(), model.weight.grad.clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # after the region: no check, a plain step
    assert torch.equal(model.weight.detach(), before.add(grad, alpha=-0.1))  # as SGD computes it


def test_check_gradients_needs_a_region():
    with pytest.raises(RuntimeError, match="inside `with sc.typecheck"):
        sc.check_gradients(nn.Linear(2, 2))


def test_main_grad_is_checked_instead_of_grad(mesh):
    model = nn.Linear(4, 3, bias=False)
    with sc.typecheck(mesh, mode="collect"):
        sc.annotate_parameters(model, tp=R)
        model.weight.main_grad = sc.annotate(torch.zeros(3, 4), tp=P)
        model.weight.grad = sc.annotate(torch.zeros(3, 4), tp=R)
        assert [f.rule for f in sc.check_gradients(model)] == ["unreduced gradient"]


def test_check_gradients_reports_where_it_is_told(mesh):
    model = nn.Linear(4, 3, bias=False)
    with sc.typecheck(mesh, mode="collect"):
        sc.annotate_parameters(model, tp=R)
        model.weight.grad = sc.annotate(torch.zeros(3, 4), tp=P)
        sc.check_gradients(model, at="model.py:7")
        sc.check_gradients(model)
        locations = [v.location for v in sc.violations()]
    assert locations[0] == "model.py:7" and locations[1].startswith(__file__)


def test_annotate_parameters_by_glob_pattern(mesh):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with sc.typecheck(mesh):
        sc.annotate_parameters(model, {"0.*": {"tp": S(0)}, "1.weight": {"tp": R}}, dp=R)
        assert sc.typeof(model[0].weight) == {"tp": S(0), "dp": R}
        assert sc.typeof(model[0].bias) == {"tp": S(0), "dp": R}
        assert sc.typeof(model[1].weight) == {"tp": R, "dp": R}
        assert sc.typeof(model[1].bias) == {"dp": R}


def norm_terms(mesh, grad_types):
    """Gradients of the given tp types, squared, summed and stacked into one norm term."""
    params = {name: nn.Parameter(torch.ones(2, 2)) for name in grad_types}
    sc.annotate_parameters(params)
    for name, p in params.items():
        p.grad = sc.annotate(torch.ones(2, 2), tp=grad_types[name], dp=R)
    return params, torch.stack([p.grad.pow(2).sum() for p in params.values()]).sum()


def test_norm_terms_are_partial_where_any_gradient_is_sharded(mesh):
    with sc.typecheck(mesh):
        _, total = norm_terms(mesh, {"w": S(0), "b": R})
        assert sc.typeof(total) == {"tp": P, "dp": R}
        dist.all_reduce(total, group=mesh.groups["tp"])
        assert sc.typeof(total) == {"tp": R, "dp": R}


def test_replicated_norm_terms_stay_replicated(mesh):
    with sc.typecheck(mesh):
        _, total = norm_terms(mesh, {"b": R})
        assert sc.typeof(total) == {"tp": R, "dp": R}


def test_summing_norms_instead_of_squares_is_flagged(mesh):
    with sc.typecheck(mesh, mode="collect"):
        params, _ = norm_terms(mesh, {"w": S(0)})
        norm = torch.linalg.vector_norm(params["w"].grad)
        dist.all_reduce(norm, group=mesh.groups["tp"])
        (record,) = sc.violations()
    assert (record.rule, record.param, record.axis) == ("norm accounting", "w", "tp")
    assert "norms (not squared norms) of w" in record.message


def zero_counts():
    """Megatron's num-zeros of two sharded gradients: each ``numel() - count_nonzero``, summed."""
    params = {name: nn.Parameter(torch.ones(2, 2)) for name in ("w", "b")}
    sc.annotate_parameters(params)
    total = torch.zeros(1, dtype=torch.int64)
    for p in params.values():
        p.grad = sc.annotate(torch.ones(2, 2), tp=S(0), dp=R)
        total = p.grad.numel() - torch.count_nonzero(p.grad) + total
    return total


def test_zero_counts_of_typed_gradients_are_a_partial_count(mesh):
    with sc.typecheck(mesh, mode="collect"):
        assert sc.typeof(zero_counts()) == {"tp": P, "dp": R}
        assert sc.violations() == []
