"""The public API: annotate/typeof/assert_type, messages, collect mode, coverage, contracts,
user rules, and typed backward passes (one process, no process group)."""

import inspect

import pytest
import torch
import torch.nn.functional as F

import shardcheck as sc

MESH = sc.Mesh(rank=0, tp=[0, 1], dp=[0, 2])
R, P, V, S = sc.R, sc.P, sc.V, sc.S


def test_annotate_typeof_and_assert_type():
    with sc.typecheck(MESH):
        x = sc.annotate(torch.randn(4, 8), tp=R, dp="V")
        w = sc.annotate(torch.randn(6, 8), tp="S(0)", dp=R)
        y = F.linear(x, w)
        assert sc.typeof(y) == {"tp": S(1), "dp": V}
        sc.assert_type(y, tp=S(-1), dp=V)
        with pytest.raises(sc.SpmdTypeError) as info:
            sc.assert_type(y, tp=R)
        assert info.value.rule == "assertion"
        assert str(info.value).startswith(f"checker: assertion at {__file__}:")
        assert sc.typeof(torch.randn(2)) == {"tp": V, "dp": V}
        assert sc.typeof(torch.randn(2)._neg_view()) == {}  # no rule: unknown


def test_annotate_rejects_unknown_axes_and_bad_placements():
    with sc.typecheck(MESH):
        with pytest.raises(ValueError, match="unknown axes"):
            sc.annotate(torch.ones(2), cp=R)
        with pytest.raises(ValueError, match="unknown placement"):
            sc.annotate(torch.ones(2), tp="Q")
    with pytest.raises(RuntimeError, match="inside `with sc.typecheck"):
        sc.annotate(torch.ones(2), tp=R)


def test_violation_message_names_user_line_rule_operands_and_fix():
    with sc.typecheck(MESH):
        y = sc.annotate(torch.randn(4, 8), tp=P, dp=V)
        line = inspect.currentframe().f_lineno + 2
        with pytest.raises(sc.SpmdTypeError) as info:
            F.gelu(y)
    lines = str(info.value).splitlines()
    assert lines[0] == (f"checker: non-linear on partial at {__file__}:{line} "
                        "in aten.gelu.default: {tp:P, dp:V}")
    assert lines[1] == "  operand 0: {tp:P, dp:V} shape (4, 8)"
    assert lines[2] == "  axis: tp (ranks [0, 1])"
    assert lines[-1] == "  fix: all_reduce over tp before gelu"
    assert info.value.location == f"{__file__}:{line}" and isinstance(info.value, RuntimeError)


def test_collect_mode_dedups_and_prints_a_summary(capsys):
    with sc.typecheck(MESH, mode="collect"):
        for _ in range(3):
            x = torch.randn(3)
            y = F.relu(sc.annotate(x, tp=P))  # same line, same rule: once
        a, b = torch.randn(3), torch.randn(3)
        z = sc.annotate(a, tp=P) * sc.annotate(b, tp=P)
        # recorded, not raised: the checker carries on with each result typed V on the axis
        assert sc.typeof(y) == sc.typeof(z) == {"tp": V, "dp": V}
    assert [r.rule for r in sc.violations()] == ["non-linear on partial", "partial product"]
    assert torch.equal(y, F.relu(x)) and torch.equal(z, a * b)  # the ops computed what plain torch does
    err = capsys.readouterr().err
    assert "shardcheck: 2 SPMD type violation(s)" in err
    assert err.count("checker: non-linear on partial at") == 1


def test_coverage_counts_typed_and_unknown_calls():
    with sc.typecheck(MESH):
        x = sc.annotate(torch.randn(3), tp=R)
        for _ in range(3):
            assert sc.typeof(x * 2) and not sc.typeof(x._neg_view())
    cov = sc.coverage()
    assert cov.typed >= 4 and cov.unknown == 3
    assert cov.top_unknown[0] == ("aten._neg_view.default", 3)
    assert str(cov).startswith("typed 4 of 7 op calls (57.1%)")


def test_contract_checks_arguments_and_types_the_result():
    @sc.contract(args={0: {"tp": S(-1)}}, returns={"tp": R})
    def vocab_parallel_loss(logits):
        return logits.exp().sum()  # a non-linear reduction the contract vouches for

    with sc.typecheck(MESH):
        loss = vocab_parallel_loss(sc.annotate(torch.randn(4, 6), tp=S(1)))
        assert sc.typeof(loss) == {"tp": R}
        with pytest.raises(sc.SpmdTypeError) as info:
            vocab_parallel_loss(sc.annotate(torch.randn(4, 6), tp=P))
        assert info.value.rule == "contract"
    assert vocab_parallel_loss.__wrapped__(torch.ones(1, 1)) == torch.e


def _routing_count(dtype=torch.long):
    """Tokens per expert on this rank: a sum over the rank's rows (S(0)) of a routing map."""
    return sc.annotate(torch.eye(4, dtype=torch.bool), tp=S(0)).sum(dim=0).to(dtype)


def _contract_messages(make_argument) -> list[str]:
    @sc.contract(args={0: {"tp": "S(0)|V"}})
    def gather(x):
        return x

    with sc.typecheck(MESH, mode="collect"):
        gather(make_argument())
        return [v.message for v in sc.violations() if v.rule == "contract"]


@pytest.mark.parametrize("make_argument", [
    lambda: sc.annotate(torch.randn(4, 2), tp=S(0)),
    lambda: sc.annotate(torch.randn(4, 2), tp=V),
    _routing_count,
    lambda: _routing_count(torch.bool),
], ids=["shard", "per-rank values", "partial count", "partial bool count"])
def test_contract_alternative_accepts_shards_values_and_partial_counts(make_argument):
    """"S(0)|V": a shard (concatenated) or per-rank values (stacked), which a partial count is:
    it has no gradient, so its pieces can be collected rather than summed."""
    assert _contract_messages(make_argument) == []


@pytest.mark.parametrize("make_argument", [
    lambda: sc.annotate(torch.randn(4, 2), tp=P),
    lambda: sc.annotate(torch.randn(4, 2), tp=S(1)),
    lambda: _routing_count(torch.float),
    lambda: sc.annotate(torch.ones(4, dtype=torch.long), tp=R),
], ids=["float partial", "shard on dim 1", "float count", "replicated count"])
def test_contract_alternative_rejects_partials_with_gradients_and_other_layouts(make_argument):
    [message] = _contract_messages(make_argument)
    assert "argument 0 must be tp=S(0)|V" in message


def test_register_rule_types_an_op():
    op = torch.ops.aten._neg_view.default
    sc.register_rule(op, lambda ctx, args, kwargs, out: ctx.types(args[0]))
    try:
        with sc.typecheck(MESH):
            x = sc.annotate(torch.randn(3), tp=S(0))
            assert sc.typeof(x._neg_view()) == {"tp": S(0), "dp": V}
    finally:
        from shardcheck.typecheck.rules.registry import unregister_rule
        unregister_rule(op)
    with sc.typecheck(MESH):  # the next region resolves the op again: no rule
        assert sc.typeof(sc.annotate(torch.randn(3), tp=S(0))._neg_view()) == {}


def test_a_number_read_from_a_per_rank_value_makes_what_it_enters_vary():
    with sc.typecheck(MESH):
        count = sc.annotate(torch.tensor([2.0, 3.0]), tp=P, dp=R).sum().item()  # differs per tp rank
        same = sc.annotate(torch.tensor([7.0]), tp=R, dp=R).item()
        x = sc.annotate(torch.randn(8), tp=R, dp=R)
        assert sc.typeof(torch.full((2,), count)) == {"tp": V, "dp": R}
        assert sc.typeof(x.narrow(0, int(count), 1)) == {"tp": V, "dp": R}
        assert sc.typeof(torch.full((2,), same)) == {"tp": R, "dp": R}
        assert sc.typeof(x[:int(same)]) == {"tp": R, "dp": R}
        assert sc.typeof(x * x) == {"tp": R, "dp": R}  # no number given


def test_backward_kernels_type_the_gradients():
    """Column- then row-parallel linear: weight grads keep their shards, the input's is P."""
    with sc.typecheck(MESH):
        x = sc.annotate(torch.randn(4, 8, requires_grad=True), tp=R, dp=V)
        w1 = sc.annotate(torch.randn(6, 8, requires_grad=True), tp=S(0), dp=R)
        w2 = sc.annotate(torch.randn(8, 6, requires_grad=True), tp=S(1), dp=R)
        F.linear(F.gelu(F.linear(x, w1)), w2).sum().backward()
        assert sc.typeof(w1.grad)["tp"] == S(0) and sc.typeof(w2.grad)["tp"] == S(1)
        assert sc.typeof(x.grad) == {"tp": P, "dp": V}


def test_layer_norm_weight_gradient_under_sequence_parallelism_is_partial():
    with sc.typecheck(MESH):
        x = sc.annotate(torch.randn(4, 8, requires_grad=True), tp=S(0), dp=V)
        weight = sc.annotate(torch.ones(8, requires_grad=True), tp=R, dp=R)
        F.layer_norm(x, (8,), weight).sum().backward()
        assert sc.typeof(weight.grad) == {"tp": P, "dp": V}
        assert sc.typeof(x.grad)["tp"] == S(0)


def _megatron_style_attention(x, w_qkv, w_proj, heads: int):
    """Megatron's core attention shapes: [s, b, h] -> heads -> [b*np, s, s] scores -> back."""
    s, b, _ = x.shape
    qkv = F.linear(x, w_qkv).view(s, b, heads, -1)
    q, k, v = torch.split(qkv, qkv.shape[-1] // 3, dim=3)
    hn = q.shape[-1]
    q, k = q.reshape(s, b * heads, hn), k.reshape(s, b * heads, hn)
    buffer = torch.empty(b * heads, s, s)
    scores = torch.baddbmm(buffer, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2),
                           beta=0.0, alpha=hn**-0.5).view(b, heads, s, s)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = F.dropout(scores.masked_fill(mask, -10000.0).softmax(-1), 0.1, True)
    v = v.reshape(s, b * heads, hn).transpose(0, 1)
    context = torch.bmm(probs.view(b * heads, s, s), v).view(b, heads, s, hn)
    context = context.permute(2, 0, 1, 3).contiguous().view(s, b, heads * hn)
    return F.linear(context, w_proj)


def test_megatron_style_attention_types_end_to_end():
    """Heads split over tp: the block-sharded [b*np] dim flows through baddbmm and bmm."""
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1])):
        x = sc.annotate(torch.randn(5, 2, 8, requires_grad=True), tp=R)
        w_qkv = sc.annotate(torch.randn(12, 8, requires_grad=True), tp=S(0))  # 2 local heads
        w_proj = sc.annotate(torch.randn(8, 4, requires_grad=True), tp=S(1))
        out = _megatron_style_attention(x, w_qkv, w_proj, heads=2)
        assert sc.typeof(out) == {"tp": P}
        out.sum().backward()
        assert sc.typeof(w_qkv.grad) == {"tp": S(0)} and sc.typeof(w_proj.grad) == {"tp": S(1)}
        assert sc.typeof(x.grad) == {"tp": P}
    assert sc.coverage().unknown == 0, sc.coverage()


def test_coverage_by_site_traces_unknowns_to_the_op_that_made_them():
    """Op calls per source line; an unknown value's descendants count at its origin."""
    import inspect

    line = inspect.currentframe().f_lineno
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1]), sites=True):
        x = sc.annotate(torch.randn(4, 4), tp=sc.S(0))
        y = x.detach().view(16).double() * 2  # views, casts and copies carry the type
        u = torch.linalg.inv(x)  # no rule: unknown here
        z = torch.nn.functional.silu(u).reshape(16) * 2  # unknown, inherited
        assert sc.typeof(y) == {"tp": sc.S(0)} and sc.typeof(z) == {}
    cov = sc.coverage()
    here = f"{__file__}:"
    sites = {loc[len(here):]: (t, u) for loc, t, u in cov.by_site if loc.startswith(here)}
    assert sites[str(line + 3)] == (4, 0)
    assert sites[str(line + 4)][0] == 0 and sites[str(line + 5)] == (0, 4)
    [(origin, count)] = cov.origins
    assert origin.startswith(f"{here}{line + 4} linalg_inv") and count == cov.unknown
    assert cov.within(here).unknown == cov.unknown and cov.within("/nowhere").typed == 0


def test_a_view_moved_over_its_storage_is_retyped_where_it_now_lies():
    """Writes retype the views they overlap, found by the storage each view spans (cached
    between writes): a view moved by ``.data =`` is found where it moved to."""
    with sc.typecheck(MESH):
        buffer = sc.annotate(torch.zeros(8), tp=R, dp=R)
        head, tail = buffer[:4], buffer[4:]
        tail.add_(sc.annotate(torch.ones(4), tp=R, dp=R))  # the views' spans are cached
        head.data = buffer[4:]  # its type comes along: R
        tail.copy_(sc.annotate(torch.ones(4), tp=V, dp=R))  # now written through head too
        assert sc.typeof(head) == {"tp": V, "dp": R}
        buffer[:4].copy_(sc.annotate(torch.ones(4), tp=P, dp=R))  # no longer head's storage
        assert sc.typeof(head) == {"tp": V, "dp": R}
