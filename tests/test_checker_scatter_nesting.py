"""Sequence parallelism where the ranks number cp fastest (Megatron's explicit groups of
``tp2-cp2-sp@cp-tp``): Megatron's reduce-scatter over tp cuts each cp rank's rows, so cp's
pieces hold tp's, against the mesh order (``S(0, outside)`` on cp), and the all-gather over tp
gives cp's rows whole again. Run on a tp2 x cp2 mesh of real Gloo ranks (cp ranks 2j, 2j+1),
forward and backward, and checked against the one-rank numbers; the rows gathered over cp
where tp was meant are told apart."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

pytest.importorskip("megatron.core")

ROWS, HIDDEN, FFN = 8, 4, 8


def _values() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=gen, dtype=torch.float64)
                 for shape in ((ROWS, HIDDEN), (HIDDEN, FFN), (FFN, HIDDEN)))


def _groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's tp group (ranks j, j+2) and cp group (ranks 2j, 2j+1)."""
    tp = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    cp = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    rank = dist.get_rank()
    return tp[rank % 2], cp[rank // 2]


def _mlp(gather_over: str) -> dict:
    """x's rows cut over cp, through a column- and a row-parallel linear; the partial sums
    reduce-scattered over tp, a GeLU, the rows gathered back over ``gather_over`` and added to
    x (the residual). Returns the types, the rules broken and the numbers."""
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    from shardcheck.megatron.cpu.patches import apply_cpu_patches

    apply_cpu_patches()  # Megatron's collectives allocate on torch.cuda.current_device()
    tp, cp = _groups()
    t, k = dist.get_rank() // 2, dist.get_rank() % 2
    x, w1, w2 = _values()
    with sc.typecheck(sc.Mesh(tp=tp, cp=cp), mode="collect"):
        rows = sc.annotate(x.chunk(2)[k].clone(), tp=sc.R, cp=sc.S(0))
        w1 = sc.annotate(w1.chunk(2, 1)[t].clone(), tp=sc.S(1), cp=sc.R).requires_grad_()
        w2 = sc.annotate(w2.chunk(2, 0)[t].clone(), tp=sc.S(0), cp=sc.R).requires_grad_()
        scattered = reduce_scatter_to_sequence_parallel_region(F.gelu(rows @ w1) @ w2, group=tp)
        gathered = gather_from_sequence_parallel_region(
            F.gelu(scattered), tensor_parallel_output_grad=False, group=tp if gather_over == "tp" else cp)
        out = gathered + rows
        (out * out).sum().backward()
        values = {"scattered": scattered, "gathered": gathered, "out": out, "w1.grad": w1.grad,
                  "w2.grad": w2.grad}
        shown = {name: ", ".join(f"{a}:{p!r}" for a, p in sc.typeof(values[name]).items())
                 for name in ("scattered", "gathered", "w1.grad", "w2.grad")}
        rules = sorted({v.rule for v in sc.violations()})
    return {"types": shown, "rules": rules, **{name: v.detach().clone() for name, v in values.items()}}


def _one_rank() -> dict[str, torch.Tensor]:
    x, w1, w2 = (v.requires_grad_() for v in _values())
    scattered = F.gelu(x @ w1) @ w2
    out = F.gelu(scattered) + x
    (out * out).sum().backward()
    return {"scattered": scattered.detach(), "out": out.detach(), "w1.grad": w1.grad, "w2.grad": w2.grad}


def _by_rank(ranks: list[dict], key: str, t: int, k: int) -> torch.Tensor:
    return ranks[2 * t + k][key]


def test_rows_cp_shards_scattered_over_tp_are_tp_pieces_inside_cp_pieces():
    ranks = spawn_ranks(_mlp, 4, "tp")
    expected = {"scattered": "tp:S(0), cp:S(0, outside)", "gathered": "tp:R, cp:S(0)",
                "w1.grad": "tp:S(1), cp:P", "w2.grad": "tp:S(0), cp:P"}
    assert [(r["types"], r["rules"]) for r in ranks] == [(expected, [])] * 4
    one = _one_rank()
    scattered = torch.cat([_by_rank(ranks, "scattered", t, k) for k in range(2) for t in range(2)])
    assert torch.allclose(scattered, one["scattered"])  # cp's pieces outside, tp's inside
    assert torch.allclose(torch.cat([_by_rank(ranks, "out", 0, k) for k in range(2)]), one["out"])
    for name, dim in (("w1.grad", 1), ("w2.grad", 0)):  # summed over cp, joined over tp
        joined = torch.cat([sum(_by_rank(ranks, name, t, k) for k in range(2)) for t in range(2)], dim)
        assert torch.allclose(joined, one[name])


def test_rows_gathered_over_cp_where_tp_was_meant_are_told_apart():
    ranks = spawn_ranks(_mlp, 4, "cp")
    assert all(r["rules"] for r in ranks)
    assert all(r["types"]["scattered"] == "tp:S(0), cp:S(0, outside)" for r in ranks)
    out = torch.cat([_by_rank(ranks, "out", 0, k) for k in range(2)])
    assert not torch.allclose(out, _one_rank()["out"])
