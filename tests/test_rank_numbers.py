"""A Python number read (``.item()``) from a per-rank value, on two real Gloo ranks: the ops the
reading code makes with it vary per rank (V), and an equal number after that code returned (a
size, an offset) is another number: what it cuts is typed as the rest of the program says."""

import pytest
import torch

import shardcheck as sc
from shardcheck.fuzz.oracle import encode, rebuild
from shardcheck.parity.pool import RankPool

FLAGS = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1])  # rank 0's rows hold 3 set flags, rank 1's 4
NUMEL = 3  # a parameter's numel, equal to rank 0's count


def _dispatch(rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A dispatcher: reads how many of its rows are set, and keeps that many of ``x``."""
    count = int(rows.sum().item())
    return x[:count]


def _finalize(buffer: torch.Tensor) -> torch.Tensor:
    """finalize_model_grads: a parameter's piece of a coalesced buffer, cut by its numel."""
    return buffer.narrow(0, 0, NUMEL)


def _on_rank(ctx):
    mesh = sc.Mesh(rank=ctx.rank, tp=ctx.groups["tp"])
    with sc.typecheck(mesh, mode="collect") as checker:
        rows = sc.annotate(FLAGS.chunk(2)[ctx.rank].clone(), tp=sc.S(0))
        kept = _dispatch(rows, sc.annotate(torch.arange(8.0), tp=sc.R))
        piece = _finalize(sc.annotate(torch.arange(10.0) * 2, tp=sc.R))
        types = [encode(checker.types(t)[0]) for t in (kept, piece)]
        records = [r.rule for r in checker.records]
    return kept.clone(), piece.clone(), types, records


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


def test_a_read_count_varies_what_its_reader_cuts_and_an_equal_size_later_does_not(pool):
    results = pool.run("tp2", _on_rank)
    assert [types for _, _, types, _ in results] == [[("V",), ("R",)]] * 2
    assert not any(records for *_, records in results)
    kept = [k for k, _, _, _ in results]
    assert kept[0].shape != kept[1].shape  # per rank: R would be wrong
    pieces = [p for _, p, _, _ in results]
    assert torch.equal(rebuild("tp2", pieces, [("R",)]), _finalize(torch.arange(10.0) * 2))
