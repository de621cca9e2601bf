"""Gradients of a vocab-parallel embedding table and of GLU's fused fc1, checked at the step.

Both used to be false alarms at Megatron's ``optimizer.step`` under tp2: the row-cut table's
gradient came out R (the lookup's backward did not know the table was cut), and GLU's fused
weight's gradient came out V (cat along the cut dim lost the sections). Each program runs
correct and with a planted bug on the same path, on one rank of a fake 4-rank group
(tp = [0, 1], dp = [0, 2]): the fake backend types collectives without moving data.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from grad_programs import CopyToRegion, ReduceFromRegion
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardcheck as sc
from shardcheck.typecheck.types import SectionShard

R, V, S = sc.R, sc.V, sc.S
VOCAB, ROWS, HIDDEN, HALF = 16, 8, 4, 4  # ROWS: this rank's rows; HALF: its part of each GLU half
FUSED = SectionShard(0, (HALF, HALF))


@pytest.fixture(scope="module")
def groups():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield {"tp": dist.new_group([0, 1]), "dp": dist.new_group([0, 2])}
    finally:
        dist.destroy_process_group()


def _checked(groups, params: dict[str, nn.Parameter], loss_of, bug: str | None):
    """Backward of ``loss_of()``, DDP's dp all-reduce (unless planted away), then the check:
    the (rule, parameter, axis) findings and each gradient's type."""
    with sc.typecheck(sc.Mesh(**groups), mode="collect"):
        loss_of().backward()
        for p in params.values():
            if bug != "dp all-reduce skipped":
                dist.all_reduce(p.grad, group=groups["dp"])
            if bug == "tp-cut gradient all-reduced over tp":
                dist.all_reduce(p.grad, group=groups["tp"])
        findings = [(f.rule, f.param, f.axis) for f in sc.check_gradients(params)]
        return findings, {name: sc.typeof(p.grad) for name, p in params.items()}


LOOKUPS = {"embedding": lambda ids, table: F.embedding(ids, table),
           "index (deterministic_mode)": lambda ids, table: table[ids]}


def _vocab_parallel_lookup(groups, lookup="embedding", bug: str | None = None):
    """Megatron's VocabParallelEmbedding: shift the token ids into this rank's rows, look them
    up, zero the tokens another rank owns, all-reduce over tp. The batch is this dp rank's own."""
    params = {"table": nn.Parameter(torch.randn(ROWS, HIDDEN)),
              "positions": nn.Parameter(torch.randn(5, HIDDEN))}

    def loss():
        sc.annotate_parameters(params, {"table": {"tp": S(0)}}, tp=R, dp=R)
        tokens = sc.annotate(torch.randint(0, VOCAB, (2, 5)), tp=R, dp=V)
        start = ROWS * dist.get_rank(groups["tp"])
        outside = (tokens < start) | (tokens >= start + ROWS)
        rows = LOOKUPS[lookup]((tokens - start).masked_fill(outside, 0), params["table"])
        words = ReduceFromRegion.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), groups["tp"])
        return (words + F.embedding(torch.arange(5), params["positions"])).pow(2).sum()
    return _checked(groups, params, loss, bug)


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_a_row_cut_table_gets_its_own_row_shard_as_gradient(groups, lookup):
    findings, grads = _vocab_parallel_lookup(groups, lookup)
    assert findings == []
    assert grads == {"table": {"tp": S(0), "dp": R}, "positions": {"tp": R, "dp": R}}


@pytest.mark.parametrize("bug, expected", [
    ("dp all-reduce skipped", {("unreduced gradient", "table", "dp"),
                               ("unreduced gradient", "positions", "dp")}),
    ("tp-cut gradient all-reduced over tp", {("gradient type mismatch", "table", "tp")}),
])
@pytest.mark.parametrize("lookup", LOOKUPS)
def test_a_row_cut_table_left_unreduced_or_summed_over_its_cut_is_flagged(groups, lookup, bug,
                                                                         expected):
    findings, _ = _vocab_parallel_lookup(groups, lookup, bug)
    assert expected <= set(findings) and all(f[1] == "table" or f[2] == "dp" for f in findings)


def _glu_mlp(groups, fc1_type=FUSED, bug=None):
    """Megatron's GLU MLP: fc1 (column-parallel, gate and up fused, each cut over tp), the
    halves chunked off its output, silu(gate) * up, fc2 (row-parallel), all-reduce over tp."""
    params = {"fc1": nn.Parameter(torch.randn(2 * HALF, HIDDEN)),
              "fc2": nn.Parameter(torch.randn(HIDDEN, HALF))}

    def loss():
        sc.annotate_parameters(params, {"fc1": {"tp": fc1_type}, "fc2": {"tp": S(1)}}, dp=R)
        x = sc.annotate(torch.randn(2, 5, HIDDEN), tp=R, dp=V)
        gate, up = torch.chunk(F.linear(CopyToRegion.apply(x, groups["tp"]), params["fc1"]), 2, -1)
        y = F.linear(F.silu(gate) * up, params["fc2"])
        return ReduceFromRegion.apply(y, groups["tp"]).pow(2).sum()
    return _checked(groups, params, loss, bug)


def test_glu_fused_weight_gradient_keeps_its_sections(groups):
    findings, grads = _glu_mlp(groups)
    assert findings == []
    assert grads == {"fc1": {"tp": FUSED, "dp": R}, "fc2": {"tp": S(1), "dp": R}}


@pytest.mark.parametrize("case, kwargs", [
    ("fc1 holds its halves in other sections than the chunk takes",
     {"fc1_type": SectionShard(0, (2, 6))}),
    ("fc1 cut as one slice, not per half", {"fc1_type": S(0)}),
    ("dp all-reduce skipped", {"bug": "dp all-reduce skipped"}),
])
def test_glu_gradient_with_its_sections_mixed_or_unreduced_is_flagged(groups, case, kwargs):
    findings, _ = _glu_mlp(groups, **kwargs)
    axis = "dp" if "bug" in kwargs else "tp"
    rule = "unreduced gradient" if "bug" in kwargs else "gradient type mismatch"
    assert (rule, "fc1", axis) in findings, findings
