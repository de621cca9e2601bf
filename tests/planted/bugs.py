"""Planted bugs in plain torch.distributed code, each with a fix switch.

Every function computes one global quantity from the local pieces held by the ranks of
``group``. Each has one silent bug. The bug is fixed when the function is called with
``fixed=True``, or when its name is listed in the ``PLANTED_FIXES`` environment variable
(comma-separated), which is how a test "applies the fix" to an emitted repro script.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def is_fixed(name: str, fixed: bool | None) -> bool:
    """Whether the bug in function ``name`` is switched off for this call."""
    if fixed is not None:
        return fixed
    return name in os.environ.get("PLANTED_FIXES", "").split(",")


def masked_mean_loss(losses: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup,
                     fixed: bool | None = None) -> torch.Tensor:
    """The mean loss over the valid (mask 1) tokens of all ranks."""
    if is_fixed("masked_mean_loss", fixed):
        totals = torch.stack([(losses * mask).sum(), mask.sum()])
        dist.all_reduce(totals, group=group)
        return totals[0] / totals[1]
    local_mean = (losses * mask).sum() / mask.sum()  # BUG: each rank's own token count
    dist.all_reduce(local_mean, group=group)
    return local_mean / dist.get_world_size(group)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float,
                                 group: dist.ProcessGroup, fixed: bool | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits whose last (vocabulary) dim is split over the ranks."""
    vocab_local = logits.shape[-1]
    start = dist.get_rank(group) * vocab_local
    peak = logits.max(-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    sum_exp = shifted.exp().sum(-1)
    dist.all_reduce(sum_exp, group=group)
    log_probs = shifted - sum_exp.log().unsqueeze(-1)
    local_target = target - start
    mine = (local_target >= 0) & (local_target < vocab_local)
    picked = log_probs.gather(-1, local_target.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
    picked = picked * mine
    sum_log_probs = log_probs.sum(-1)
    dist.all_reduce(picked, group=group)
    dist.all_reduce(sum_log_probs, group=group)
    vocab = vocab_local
    if is_fixed("vocab_parallel_cross_entropy", fixed):
        vocab = vocab_local * dist.get_world_size(group)  # BUG above: the local vocabulary size
    loss = -(1 - label_smoothing) * picked - label_smoothing * sum_log_probs / vocab
    return loss.mean()


def weighted_token_mean(values: torch.Tensor, mask: torch.Tensor | None, group: dist.ProcessGroup,
                        fixed: bool | None = None) -> torch.Tensor:
    """The mean over all ranks' tokens, as each rank's mean weighted by its share of tokens."""
    if mask is None:
        local_count: torch.Tensor | int = values.shape[0]
        global_count = torch.tensor(float(values.shape[0]))
        local_sum = values.sum()
    else:
        local_count = mask.sum()
        global_count = local_count  # BUG: aliases the local count, reduced in place below
        if is_fixed("weighted_token_mean", fixed):
            global_count = local_count.clone()
        local_sum = (values * mask).sum()
    local_mean = local_sum / local_count
    dist.all_reduce(global_count, group=group)
    weighted = local_mean * (local_count / global_count)
    dist.all_reduce(weighted, group=group)
    return weighted


def split_sequence_sum(sequence: torch.Tensor, group: dist.ProcessGroup,
                       fixed: bool | None = None) -> torch.Tensor:
    """The sum over a sequence (dim 0) of which each rank sums its own contiguous piece."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if is_fixed("split_sequence_sum", fixed):
        piece = sequence.tensor_split(world)[rank]
    else:
        chunk = sequence.shape[0] // world  # BUG: drops the tail when the length does not divide
        piece = sequence[rank * chunk:(rank + 1) * chunk]
    total = piece.sum(0)
    dist.all_reduce(total, group=group)
    return total
