"""Fuzz targets for the planted bugs: batches, per-rank calls, scenarios, spaces and repro bodies.

Each ``*_run(group, **config, fixed=None)`` takes this rank's piece of a global batch (built the
same way on every rank) and calls the planted function on ``group``. On a one-rank group it
sees the whole batch, which is the reference. The scenarios wrap the runs for the fuzzer, and
the repro scripts include the batch builders and runs verbatim, so both execute the same code.
``masked_mean`` instead shards its inputs with ``ctx.shard``, declaring their types, so that
the type checker runs on it too; plain code that slices by rank internally has no declared
types, and its targets run parity alone.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from hypothesis import strategies as st

from planted.bugs import (
    masked_mean_loss,
    split_sequence_sum,
    vocab_parallel_cross_entropy,
    weighted_token_mean,
)
from shardcheck import R, S
from shardcheck.fuzz.campaign import Campaign, fuzz, register_fuzz_target
from shardcheck.fuzz.repro import ScriptBody
from shardcheck.fuzz.spaces import option, per_rank, space

FIX = {"fixed": True}


def mine(rows: Sequence[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's share of the batch's rows, split evenly over the group."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    share = len(rows) // world
    return torch.cat(list(rows[rank * share:(rank + 1) * share]))


def masked_batch(seq_len: int, padding: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Losses 1, 2, 3, ... in one row per data rank; the last padding[r] tokens of row r are masked."""
    losses = torch.arange(1.0, len(padding) * seq_len + 1).reshape(len(padding), seq_len)
    mask = torch.ones_like(losses)
    for row, pad in enumerate(padding):
        mask[row, seq_len - pad:] = 0.0
    return losses, mask


def masked_mean_run(group, seq_len, padding, fixed=None):
    losses, mask = masked_batch(seq_len, padding)
    return masked_mean_loss(mine(losses.split(1), group), mine(mask.split(1), group), group, fixed)


def smoothed_ce_run(group, tokens, vocab, label_smoothing, fixed=None):
    logits = torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(0))
    target = torch.arange(tokens) % vocab
    vocab_shard = mine(logits.T.split(1), group).T
    return vocab_parallel_cross_entropy(vocab_shard, target, label_smoothing, group, fixed)


def token_mean_run(group, tokens_per_rank, use_mask, fixed=None):
    values = torch.arange(1.0, sum(tokens_per_rank) + 1)
    local = mine(values.split(tokens_per_rank), group)
    return weighted_token_mean(local, torch.ones_like(local) if use_mask else None, group, fixed)


def sequence_sum_run(group, seq_len, hidden, fixed=None):
    sequence = torch.arange(1.0, seq_len * hidden + 1).reshape(seq_len, hidden)
    return split_sequence_sum(sequence, group, fixed)


def _outputs(ctx, axis: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"value": ctx.declare(value, **{axis: R})}


def masked_mean(ctx, seq_len=1, padding=(0,), fixed=None):
    """Declares its inputs' types (S(0) over dp), so the type checker runs on it too."""
    losses, mask = masked_batch(seq_len, list(padding))
    local_losses, local_mask = ctx.shard(losses, S(0), "dp"), ctx.shard(mask, S(0), "dp")
    return _outputs(ctx, "dp", masked_mean_loss(local_losses, local_mask, ctx.groups["dp"], fixed))


def smoothed_ce(ctx, tokens=1, vocab=2, label_smoothing=0.0, fixed=None):
    return _outputs(ctx, "tp", smoothed_ce_run(ctx.groups["tp"], tokens, vocab, label_smoothing, fixed))


def token_mean(ctx, tokens_per_rank=(1,), use_mask=False, fixed=None):
    return _outputs(ctx, "dp", token_mean_run(ctx.groups["dp"], list(tokens_per_rank), use_mask, fixed))


def sequence_sum(ctx, seq_len=1, hidden=1, fixed=None):
    return _outputs(ctx, "cp", sequence_sum_run(ctx.groups["cp"], seq_len, hidden, fixed))


_BODY_CALLS = '''

def observed() -> torch.Tensor:
    return RUN(dist.group.WORLD, **CONFIG)


def reference() -> torch.Tensor:
    """The same call on a one-rank group, which holds the whole batch."""
    alone, _ = dist.new_subgroups(group_size=1)
    return RUN(alone, **CONFIG)


def corrected() -> torch.Tensor:
    return RUN(dist.group.WORLD, **CONFIG, fixed=True)
'''


def planted_body(run: Callable, planted: Callable, *helpers: Callable) -> Callable[..., ScriptBody]:
    """A repro hook: the script holds the batch helpers and the run, and calls the planted code."""
    code = "\n\n".join(inspect.getsource(f) for f in (mine, *helpers, run))
    body = ScriptBody(code=code + _BODY_CALLS.replace("RUN", run.__name__),
                      imports=f"from {planted.__module__} import {planted.__name__}", has_corrected=True,
                      sys_path=(str(Path(__file__).resolve().parent.parent),))
    return lambda finding: body


def _register(name: str, scenario: Callable, strategy: st.SearchStrategy, run: Callable,
              planted: Callable, *helpers: Callable, typecheck: bool = False) -> None:
    """Register a planted target; the type checker only runs where inputs have declared types."""
    register_fuzz_target(name, scenario, strategy, fix=FIX, repro=planted_body(run, planted, *helpers),
                         typecheck=typecheck)


_register("planted-masked-mean", masked_mean,
          space(["dp2", "dp3", "dp4"], seq_len=st.integers(1, 6),
                padding=per_rank("dp", lambda layout, drawn: st.integers(0, drawn["seq_len"] - 1))),
          masked_mean_run, masked_mean_loss, masked_batch, typecheck=True)
_register("planted-smoothed-ce", smoothed_ce,
          space(["tp2", "tp3", "tp4"], tokens=st.integers(1, 4),
                vocab=lambda layout, drawn: st.integers(1, 4).map(lambda v: v * layout.tp),
                label_smoothing=option(0.0, 0.1, 0.2)),
          smoothed_ce_run, vocab_parallel_cross_entropy)
_register("planted-token-mean", token_mean,
          space(["dp2", "dp3", "dp4"], tokens_per_rank=per_rank("dp", st.integers(1, 4)),
                use_mask=option(False, True)),
          token_mean_run, weighted_token_mean)
_register("planted-sequence-sum", sequence_sum,
          space(["cp2", "cp3", "cp4"], seq_len=st.integers(1, 12), hidden=st.integers(1, 3)),
          sequence_sum_run, split_sequence_sum)


@functools.cache
def campaign(name: str) -> Campaign:
    """One fuzz campaign per planted target (budget 30, seed 0), shared by the tests."""
    root = tempfile.mkdtemp(prefix=f"shardcheck-{name}-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return fuzz(name, budget=30, seed=0, root=root)
