"""Remembered rule outcomes (typecheck/op_memo.py): an op met again with the same signature is
typed as its rule types it, without running the rule; a violation is found every time; an
operand the rule may read more of, a tensor given twice, a list of tensors or a user's own
rule leaves the op to its rule. In one process, on meshes of fake ranks."""

import pytest
import torch
import torch.nn.functional as F

import shardcheck as sc
from shardcheck.typecheck import op_memo, tensor_state
from shardcheck.typecheck.checker import current
from shardcheck.typecheck.rank_branches import RankDerived
from shardcheck.typecheck.rules import registry

MESH = sc.Mesh(rank=0, tp=[0, 1], dp=[0, 2])


@pytest.fixture
def kept(monkeypatch) -> list:
    """The signatures whose outcomes are kept during the test (from an empty memo)."""
    monkeypatch.setattr(op_memo, "OUTCOMES", {})
    signatures: list = []
    keep = op_memo.keep
    monkeypatch.setattr(op_memo, "keep", lambda sig, pl, flags: (signatures.append(sig), keep(sig, pl, flags)))
    return signatures


def _program() -> list[dict]:
    """The types of a column- then row-parallel MLP with a bias, a norm and a loss."""
    x = sc.annotate(torch.randn(4, 8), tp=sc.R, dp=sc.V)
    w1 = sc.annotate(torch.randn(8, 6), tp=sc.S(1), dp=sc.R)
    w2 = sc.annotate(torch.randn(6, 8), tp=sc.S(0), dp=sc.R)
    bias = sc.annotate(torch.randn(6), tp=sc.S(0), dp=sc.R)
    w3 = sc.annotate(torch.randn(8, 8), tp=sc.R, dp=sc.R)
    scale = sc.annotate(torch.ones(8), tp=sc.R, dp=sc.R)
    h = F.gelu(torch.mm(x, w1) + bias)
    y = torch.mm(h, w2)  # partial sums over tp
    z = y * 2.0 - y / 4
    total = z.sum(0)
    normed = F.layer_norm(torch.mm(x, w3) + x, (8,), scale, torch.zeros(8))
    return [sc.typeof(t) for t in (h, y, z, total, normed, normed.sum())]


def test_a_remembered_outcome_types_the_result_as_the_rule_does(kept):
    with sc.typecheck(MESH):
        first = _program()
    learnt = len(kept)
    assert learnt >= 8 and len(op_memo.OUTCOMES) == learnt
    with sc.typecheck(MESH):  # another region on the same mesh: every outcome is remembered
        again = _program()
    assert again == first and len(kept) == learnt
    assert first[1] == {"tp": sc.P, "dp": sc.V} and first[3] == {"tp": sc.P, "dp": sc.V}


def test_a_violation_is_found_every_time(kept):
    with sc.typecheck(MESH, mode="collect"):
        y = torch.mm(sc.annotate(torch.randn(4, 6), tp=sc.S(1)), sc.annotate(torch.randn(6, 8), tp=sc.S(0)))
        for _ in range(2):
            F.gelu(y)  # non-linear on partial, once per line
        F.gelu(y)
        assert len(sc.violations()) == 2
    with sc.typecheck(MESH):
        for _ in range(2):
            with pytest.raises(sc.SpmdTypeError, match="non-linear on partial"):
                F.gelu(y)
    assert not any(sig[0] == id(torch.ops.aten.gelu.default) for sig in kept)


def test_an_operand_with_more_than_a_type_is_left_to_the_rule(kept):
    with sc.typecheck(MESH):
        x = sc.annotate(torch.randn(4, 8), tp=sc.R, dp=sc.V)
        assert op_memo.signature(1, current().key, (x, 2.0), {}) is not None
        tensor_state.write(x, "broadcast", (x._version, ()))  # a field the elementwise rules read
        assert op_memo.signature(1, current().key, (x, 2.0), {}) is None
        assert op_memo.signature(1, current().key, (x.detach(), x.detach()), {}) is not None
        same = x.detach()
        assert op_memo.signature(1, current().key, (same, same), {}) is None  # a square
        assert op_memo.signature(1, current().key, ([same], 0), {}) is None
        assert op_memo.signature(1, current().key, (x.detach(), RankDerived(1, (0,))), {}) is None
        assert op_memo.signature(1, current().key, (x.detach().to_sparse(),), {}) is None


def test_a_users_own_rule_is_not_remembered():
    mm = torch.ops.aten.mm.default
    assert op_memo.memoised(mm, registry.rule_for(mm))
    registry.register_rule(mm, lambda ctx, args, kwargs, out: (sc.V,) * ctx.n)
    try:
        assert not op_memo.memoised(mm, registry.rule_for(mm))
        with sc.typecheck(MESH):
            w = sc.annotate(torch.randn(8, 8), tp=sc.R, dp=sc.R)
            assert sc.typeof(torch.mm(w, w)) == {"tp": sc.V, "dp": sc.V}
    finally:
        registry.unregister_rule(mm)
    assert op_memo.memoised(mm, registry.rule_for(mm))
