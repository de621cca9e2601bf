"""Plain-torch programs on real Gloo ranks for three shapes of code Megatron has: a row lookup
in a vocab-sharded table written as ``table[indices]``, a two-stage pipeline with a chunk-based
GLU, and DDP-style gradients in views of a flat buffer reduced by one collective. Each has a
correct variant (clean) and a buggy one (flagged)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

VOCAB, HIDDEN, FFN = 8, 4, 6
pytestmark = pytest.mark.slow


def _seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rules() -> list[str]:
    return [r.rule for r in sc.violations()]


# ---- vocab-parallel lookup as table[indices] (Megatron's deterministic_mode) ---------------

def _vocab_lookup(by_index: bool, reduce: bool) -> dict:
    group, rank = dist.group.WORLD, dist.get_rank()
    rows = VOCAB // 2
    tokens = torch.tensor([[0, 5, 3, 7]])
    table = _seeded(VOCAB, HIDDEN, seed=0)[rank * rows:(rank + 1) * rows]
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        sc.annotate(table, tp=sc.S(0))
        sc.annotate(tokens, tp=sc.R)
        outside = (tokens < rank * rows) | (tokens >= (rank + 1) * rows)
        local = tokens.clone() - rank * rows
        local[outside] = 0
        out = table[local] if by_index else F.embedding(local, table)
        out[outside, :] = 0.0
        if reduce:
            dist.all_reduce(out, group=group)
        normed = F.layer_norm(out, (HIDDEN,))
        types = {"lookup": repr(sc.typeof(out)), "normed": repr(sc.typeof(normed))}
    return {**types, "rules": _rules(), "value": out.tolist()}


@pytest.fixture(scope="module")
def lookups():
    return {(by_index, reduce): spawn_ranks(_vocab_lookup, 2, by_index, reduce)
            for by_index in (True, False) for reduce in (True, False)}


def test_row_lookup_by_index_is_typed_as_the_embedding_lookup(lookups):
    reference = F.embedding(torch.tensor([[0, 5, 3, 7]]), _seeded(VOCAB, HIDDEN, seed=0))
    for by_index in (True, False):
        for rank in lookups[(by_index, True)]:
            assert rank["rules"] == [] and rank["lookup"] == "{'tp': R}"
            torch.testing.assert_close(torch.tensor(rank["value"]), reference)


def test_row_lookup_without_the_all_reduce_is_flagged(lookups):
    for by_index in (True, False):
        for rank in lookups[(by_index, False)]:
            assert rank["lookup"] == "{'tp': P}"
            assert rank["rules"] == ["non-linear on partial"]


# ---- two pipeline stages with a chunk-based GLU ---------------------------------------------

def _glu(x: torch.Tensor) -> torch.Tensor:
    gate, linear = torch.chunk(x, 2, dim=-1)
    return F.gelu(gate) * linear


def _two_stage_pipeline(stage_weights: str, loss_summed_after_broadcast: bool) -> dict:
    """Stage 0 runs its layer and sends the activation; stage 1 receives, runs its own layer,
    and the loss is broadcast from the last stage."""
    group, stage = dist.group.WORLD, dist.get_rank()
    with sc.typecheck(sc.Mesh(pp=group), mode="collect"):
        x = sc.annotate(_seeded(3, HIDDEN, seed=1), pp=sc.R)
        weight = sc.annotate(_seeded(2 * HIDDEN, HIDDEN, seed=10 + stage), pp=stage_weights)
        if stage == 0:
            dist.send(_glu(x @ weight.t()), dst=1)
            loss = torch.zeros(())
        else:
            hidden = torch.empty(3, HIDDEN)
            dist.recv(hidden, src=0)
            loss = _glu(hidden @ weight.t()).sum()
        dist.broadcast(loss, src=1, group=group)
        if loss_summed_after_broadcast:
            dist.all_reduce(loss, group=group)
        types = repr(sc.typeof(loss))
    return {"rules": _rules(), "loss": types, "value": float(loss)}


def _pipeline_reference() -> float:
    x = _seeded(3, HIDDEN, seed=1)
    hidden = _glu(x @ _seeded(2 * HIDDEN, HIDDEN, seed=10).t())
    return float(_glu(hidden @ _seeded(2 * HIDDEN, HIDDEN, seed=11).t()).sum())


def test_two_stage_pipeline_with_glu_is_clean():
    for rank in spawn_ranks(_two_stage_pipeline, 2, "V", False):
        assert rank["rules"] == [] and rank["loss"] == "{'pp': R}"
        assert rank["value"] == pytest.approx(_pipeline_reference(), rel=1e-6)


def test_loss_summed_over_stages_after_its_broadcast_is_flagged():
    for rank in spawn_ranks(_two_stage_pipeline, 2, "V", True):
        assert rank["rules"] == ["double count"]


# ---- DDP-style gradients in views of a flat buffer ------------------------------------------

def _flat_buffer_step(reduce: bool, coalesced: bool) -> list[str]:
    """Gradients accumulate into ``main_grad`` views of one flat buffer made before the typed
    region (as DDP does at construction); one collective reduces the whole buffer."""
    group, rank = dist.group.WORLD, dist.get_rank()
    model = torch.nn.Linear(HIDDEN, FFN)
    buffer = torch.zeros(sum(p.numel() for p in model.parameters()))
    start = 0
    for param in model.parameters():
        param.main_grad = buffer[start:start + param.numel()].view(param.shape)
        start += param.numel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with sc.typecheck(sc.Mesh(dp=group), mode="collect"):
        sc.annotate_parameters(model, dp=sc.R)
        for param in model.parameters():
            sc.annotate(param.main_grad, dp=sc.R)
        batch = sc.annotate(_seeded(2, HIDDEN, seed=20 + rank), dp=sc.V)
        model(batch).square().mean().backward()
        for param in model.parameters():
            param.main_grad.add_(param.grad)
        if reduce:
            with dist._coalescing_manager(group) if coalesced else torch.no_grad():
                dist.all_reduce(buffer, group=group)
            buffer /= dist.get_world_size(group)
        optimizer.step()
    return [f"{r.rule}: {r.message.splitlines()[0].split(': ', 2)[-1]}" for r in sc.violations()]


@pytest.mark.parametrize("coalesced", [False, True], ids=["all_reduce", "coalesced"])
def test_buffer_all_reduce_reaches_every_main_grad_view(coalesced):
    for rank in spawn_ranks(_flat_buffer_step, 2, True, coalesced):
        assert rank == []


def test_skipped_buffer_all_reduce_is_an_unreduced_gradient_at_the_step():
    for rank in spawn_ranks(_flat_buffer_step, 2, False, False):
        assert len(rank) == 2 and all(r.startswith("unreduced gradient:") for r in rank)
        assert all("parameter R on dp, gradient V" in r for r in rank)
