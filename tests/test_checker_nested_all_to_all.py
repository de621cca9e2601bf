"""Mamba's and GDN's context-parallel all-to-alls on a tp2 x cp2 mesh of real Gloo ranks: each
tp rank's columns cut into cp pieces (tp outside cp) and joined back, with a per-column weight
sliced by cp rank from each tp rank's piece, checked against the one-rank numbers; the weight
sliced with cp outside tp instead is told from it. GDN's fused sections, permuted so that one
all-to-all gives every cp rank its piece of each section, likewise; unpermuted, they are no
shard."""

import pytest
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks
from shardcheck.typecheck.types import SectionShard

pytest.importorskip("megatron.core")

ROWS, COLS = 8, 8


def _values() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(ROWS, COLS, generator=gen, dtype=torch.float64),
            torch.randn(COLS, generator=gen, dtype=torch.float64))


def _groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's tp group (ranks 2k, 2k+1) and cp group (ranks t, t+2)."""
    tp = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    cp = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    rank = dist.get_rank()
    return tp[rank // 2], cp[rank % 2]


def _weight_piece(weight: torch.Tensor, t: int, k: int, cp_outside: bool) -> torch.Tensor:
    """This rank's piece of the per-column weight: cp rank k's slice of tp rank t's columns
    (Mamba's ``_slice_vector_param`` of a tp-sharded parameter), or, ``cp_outside``, tp rank
    t's slice of cp rank k's columns."""
    outer, inner = (k, t) if cp_outside else (t, k)
    cut = {"cp": sc.S(0), "tp": sc.R} if cp_outside else {"tp": sc.S(0), "cp": sc.R}
    piece = sc.annotate(weight.chunk(2)[outer].clone(), **cut)
    return piece[inner * 2:(inner + 1) * 2]


def _mixed(cp_outside: bool) -> tuple[dict[str, str], list[str], torch.Tensor, torch.Tensor]:
    """x (rows cut over cp, columns over tp) to the whole sequence with cp's piece of each tp
    rank's columns, times the weight, summed along the sequence, and back to the rows."""
    from megatron.core.tensor_parallel.mappings import all_to_all_hp2sp, all_to_all_sp2hp

    tp, cp = _groups()
    t, k = dist.get_rank() % 2, dist.get_rank() // 2
    full, weight = _values()
    with sc.typecheck(sc.Mesh(tp=tp, cp=cp), mode="collect"):
        x = full.chunk(2, 0)[k].chunk(2, 1)[t].clone().requires_grad_()
        sc.annotate(x, tp=sc.S(1), cp=sc.S(0))
        hidden = all_to_all_sp2hp(x, cp)
        mixed = (hidden * _weight_piece(weight, t, k, cp_outside)).cumsum(0)
        rows = all_to_all_hp2sp(mixed, cp)
        return _outcome(x, hidden, rows)


def _outcome(x: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor) -> tuple:
    """Inside the checked region: backward from ``rows``, then the types of the all-to-alls'
    results and of x's gradient, the rules broken, the result and x's gradient."""
    (rows * rows).sum().backward()
    types = {"sp2hp": sc.typeof(hidden), "hp2sp": sc.typeof(rows), "x.grad": sc.typeof(x.grad)}
    shown = {name: ", ".join(f"{a}:{p!r}" for a, p in pl.items()) for name, pl in types.items()}
    return shown, sorted({v.rule for v in sc.violations()}), rows.detach().clone(), x.grad.detach().clone()


def _one_rank() -> tuple[torch.Tensor, torch.Tensor]:
    full, weight = _values()
    full.requires_grad_()
    rows = (full * weight).cumsum(0)
    (rows * rows).sum().backward()
    return rows.detach(), full.grad


def _whole(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The global value of rank pieces cut by rows over cp (slower) and columns over tp."""
    return torch.cat([torch.cat(pieces[2 * k:2 * k + 2], dim=1) for k in range(2)], dim=0)


def test_columns_cut_into_cp_pieces_inside_tp_and_joined_back_are_the_shards_they_make():
    ranks = spawn_ranks(_mixed, 4, False)
    expected = {"sp2hp": "tp:S(1, outside), cp:S(1)", "hp2sp": "tp:S(1), cp:S(0)",
                "x.grad": "tp:S(1), cp:S(0)"}
    assert [r[:2] for r in ranks] == [(expected, [])] * 4
    rows, grad = _one_rank()
    assert torch.allclose(_whole([r[2] for r in ranks]), rows)
    assert torch.allclose(_whole([r[3] for r in ranks]), grad)


def test_a_weight_sliced_with_cp_outside_tp_does_not_line_up_with_the_pieces():
    ranks = spawn_ranks(_mixed, 4, True)
    assert all("mixed shards" in r[1] for r in ranks)
    assert not torch.allclose(_whole([r[2] for r in ranks]), _one_rank()[0])


def _sections(permuted: bool) -> tuple[dict[str, str], list[str], torch.Tensor, torch.Tensor]:
    """x with two fused sections A and B (tp's piece of each, rows over cp), permuted so that
    chunk k of each section goes to cp rank k (GDN's head permutation), to the whole sequence;
    A times B times the weight, summed along the sequence, back to the rows."""
    from megatron.core.tensor_parallel.mappings import all_to_all_hp2sp, all_to_all_sp2hp

    tp, cp = _groups()
    t, k = dist.get_rank() % 2, dist.get_rank() // 2
    full, weight = _values()
    fused = torch.cat([full, full.flip(1)], dim=1)  # A and B, COLS each
    with sc.typecheck(sc.Mesh(tp=tp, cp=cp), mode="collect"):
        a, b = fused.chunk(2, 0)[k].split(COLS, dim=1)
        x = torch.cat([a.chunk(2, 1)[t], b.chunk(2, 1)[t]], dim=1).clone().requires_grad_()
        sc.annotate(x, tp=SectionShard(1, (COLS // 2, COLS // 2)), cp=sc.S(0))
        order = torch.cat([torch.arange(0, 4).view(2, -1), torch.arange(4, 8).view(2, -1)], dim=-1).view(-1)
        hidden = all_to_all_sp2hp(x.index_select(1, order) if permuted else x, cp)
        a, b = hidden.split(COLS // 4, dim=1)
        rows = all_to_all_hp2sp((a * b * _weight_piece(weight, t, k, False)).cumsum(0), cp)
        return _outcome(x, hidden, rows)


def _sections_one_rank() -> tuple[torch.Tensor, torch.Tensor]:
    full, weight = _values()
    fused = torch.cat([full, full.flip(1)], dim=1).requires_grad_()
    a, b = fused.split(COLS, dim=1)
    rows = (a * b * weight).cumsum(0)
    (rows * rows).sum().backward()
    return rows.detach(), fused.grad


def _fused_whole(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The global value of rank pieces holding tp's piece of each of two sections (columns)."""
    halves = [[p.chunk(2, 1)[s] for p in pieces] for s in range(2)]
    return torch.cat([_whole(half) for half in halves], dim=1)


def test_sections_permuted_for_one_all_to_all_are_each_cut_into_cp_pieces_inside_tp():
    ranks = spawn_ranks(_sections, 4, True)
    expected = {"sp2hp": "tp:S(1, sections=[2, 2], outside), cp:S(1, sections=[2, 2])",
                "hp2sp": "tp:S(1), cp:S(0)", "x.grad": "tp:S(1, sections=[4, 4]), cp:S(0)"}
    assert [r[:2] for r in ranks] == [(expected, [])] * 4
    rows, grad = _sections_one_rank()
    assert torch.allclose(_whole([r[2] for r in ranks]), rows)
    assert torch.allclose(_fused_whole([r[3] for r in ranks]), grad)


def test_sections_sent_unpermuted_are_no_shard():
    ranks = spawn_ranks(_sections, 4, False)
    assert all(r[0]["hp2sp"].startswith("tp:V") for r in ranks)
    assert not torch.allclose(_whole([r[2] for r in ranks]), _sections_one_rank()[0])
