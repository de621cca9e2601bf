"""Megatron's pipeline transfers (``_batched_p2p_ops``, ``_p2p_ops``) carry their tensors'
types: on a tp2 x pp2 mesh of real Gloo ranks, the second stage receives the first stage's
hidden states typed, runs a column-parallel linear on them, and sends their gradient back,
typed too; checked against the one-rank numbers. An all-reduce over tp of the received
replicated hidden states, which no type flagged while a received tensor was unknown, is a
double count."""

import pytest
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

pytest.importorskip("megatron.core")

ROWS, HIDDEN = 4, 8


def _values() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=gen, dtype=torch.float64)
                 for shape in ((ROWS, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, HIDDEN)))


def _groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's tp group (ranks 2s, 2s+1 of stage s) and pp group (ranks t, t+2)."""
    tp = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    pp = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    rank = dist.get_rank()
    return tp[rank // 2], pp[rank % 2]


def _transfer(p2p: str, group: dist.ProcessGroup, send: torch.Tensor | None = None,
              receive: torch.Tensor | None = None, to_next: bool = True) -> None:
    """Megatron's own transfer function ``p2p`` sends ``send`` or receives into ``receive``,
    to or from the next stage (``to_next``) or the previous one, and waits."""
    from megatron.core.pipeline_parallel import p2p_communication

    rank, ranks = dist.get_rank(), dist.get_process_group_ranks(group)
    peer = ranks[1 - ranks.index(rank)]
    slots = {"tensor_send_prev": None, "tensor_recv_prev": None, "tensor_send_next": None,
             "tensor_recv_next": None}
    slots[f"tensor_{'send' if send is not None else 'recv'}_{'next' if to_next else 'prev'}"] = (
        send if send is not None else receive)
    reqs = getattr(p2p_communication, p2p)(**slots, group=group, prev_pipeline_rank=peer,
                                           next_pipeline_rank=peer)
    for work in reqs.values() if isinstance(reqs, dict) else reqs:
        work.wait()


def _two_stages(p2p: str, reduced_again: bool) -> dict:
    """Stage 0: a row-parallel linear, all-reduced over tp, sent on. Stage 1: the received
    hidden states (all-reduced over tp again, ``reduced_again``: the bug) into a
    column-parallel linear and the loss; the hidden states' gradient sent back for stage 0's
    backward."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    from shardcheck.megatron.checks.pipeline_types import received_activations_typed
    from shardcheck.megatron.cpu.patches import apply_cpu_patches

    apply_cpu_patches()
    tp, pp = _groups()
    t, stage = dist.get_rank() % 2, dist.get_rank() // 2
    x, w1, w2 = _values()
    with received_activations_typed(), sc.typecheck(sc.Mesh(tp=tp, pp=pp), mode="collect"):
        if stage == 0:
            rows = sc.annotate(x.chunk(2, 1)[t].clone(), tp=sc.S(1), pp=sc.R)
            weight = sc.annotate(w1.chunk(2, 0)[t].clone(), tp=sc.S(0), pp=sc.V).requires_grad_()
            hidden = reduce_from_tensor_model_parallel_region(rows @ weight, group=tp)
            _transfer(p2p, pp, send=hidden.detach())
            grad = torch.empty(ROWS, HIDDEN, dtype=torch.float64)
            _transfer(p2p, pp, receive=grad)
            received_type = sc.typeof(grad)
            hidden.backward(grad)
            result = weight.grad
        else:
            hidden = torch.empty(ROWS, HIDDEN, dtype=torch.float64)
            _transfer(p2p, pp, receive=hidden, to_next=False)
            received_type = sc.typeof(hidden)
            hidden.requires_grad_()
            whole = reduce_from_tensor_model_parallel_region(hidden, group=tp) if reduced_again else hidden
            weight = sc.annotate(w2.chunk(2, 1)[t].clone(), tp=sc.S(1), pp=sc.V)
            out = copy_to_tensor_model_parallel_region(whole, group=tp) @ weight
            (out * out).sum().backward()
            _transfer(p2p, pp, send=hidden.grad, to_next=False)
            result = out
        found = {"received": received_type, "result": sc.typeof(result),
                 "rules": sorted({v.rule for v in sc.violations()})}
    return {**found, "value": result.detach().clone()}


def _one_rank() -> tuple[torch.Tensor, torch.Tensor]:
    x, w1, w2 = _values()
    w1.requires_grad_()
    out = (x @ w1) @ w2
    (out * out).sum().backward()
    return out.detach(), w1.grad


@pytest.mark.parametrize("p2p", ["_batched_p2p_ops", "_p2p_ops"])
def test_hidden_states_and_their_gradient_arrive_with_the_senders_types(p2p):
    ranks = spawn_ranks(_two_stages, 4, p2p, False)
    assert [r["rules"] for r in ranks] == [[]] * 4
    assert [r["received"] for r in ranks] == [{"tp": sc.R, "pp": sc.V}] * 4
    assert [r["result"] for r in ranks] == [{"tp": sc.S(0), "pp": sc.V}] * 2 + [{"tp": sc.S(1), "pp": sc.V}] * 2
    out, grad = _one_rank()
    assert torch.allclose(torch.cat([ranks[2]["value"], ranks[3]["value"]], 1), out)
    assert torch.allclose(torch.cat([ranks[0]["value"], ranks[1]["value"]], 0), grad)


def test_received_hidden_states_all_reduced_again_are_a_double_count():
    ranks = spawn_ranks(_two_stages, 4, "_batched_p2p_ops", True)
    assert [r["rules"] for r in ranks[2:]] == [["double count"]] * 2
    assert not torch.allclose(torch.cat([ranks[2]["value"], ranks[3]["value"]], 1), _one_rank()[0])
