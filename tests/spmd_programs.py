"""Small tensor-parallel programs in plain torch.distributed, each correct or buggy.

Each program runs on real Gloo ranks under ``sc.typecheck`` and returns its result. A line
that breaks a rule carries a ``# BUG: <rule>`` marker, which the tests look up to assert the
exact file:line the checker reports.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardcheck as sc
from shardcheck.typecheck.checker import current

HIDDEN, FFN, TOKENS, VOCAB = 8, 16, 8, 12


def marker_line(rule: str, occurrence: int = 0) -> str:
    """file:line of the ``# BUG: <rule>`` marker (the n-th one) in this file."""
    with open(__file__) as src:
        hits = [n for n, line in enumerate(src, 1) if line.rstrip().endswith(f"# BUG: {rule}")]
    return f"{__file__}:{hits[occurrence]}"


def seeded(*shape: int, seed: int) -> torch.Tensor:
    """A random tensor that is the same on every rank, so it is declared replicated.

    (A random factory alone types as V: the checker cannot know the generator is seeded.)
    """
    value = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return sc.annotate(value, tp=sc.R) if current() else value


def full_weights() -> dict[str, torch.Tensor]:
    """The unsharded parameters and input, identical on every rank."""
    return {"x": seeded(TOKENS, HIDDEN, seed=0), "w1": seeded(FFN, HIDDEN, seed=1),
            "b1": seeded(FFN, seed=2), "w2": seeded(HIDDEN, FFN, seed=3),
            "b2": seeded(HIDDEN, seed=4)}


def reference_mlp() -> torch.Tensor:
    """What one device computes."""
    p = full_weights()
    return F.linear(F.gelu(F.linear(p["x"], p["w1"], p["b1"])), p["w2"], p["b2"])


def _shards(group) -> dict[str, torch.Tensor]:
    """This rank's column-parallel (w1, b1) and row-parallel (w2) shards, sliced by rank."""
    p, r, n = full_weights(), dist.get_rank(group), dist.get_world_size(group)
    f = FFN // n
    return {
        "x": p["x"],
        "w1": p["w1"][r * f:(r + 1) * f],
        "b1": p["b1"][r * f:(r + 1) * f],
        "w2": p["w2"][:, r * f:(r + 1) * f],
        "b2": p["b2"],
    }


def mlp(group) -> torch.Tensor:
    """Column-parallel then row-parallel MLP, all-reduce after the row-parallel matmul."""
    w = _shards(group)
    h = F.gelu(F.linear(w["x"], w["w1"], w["b1"]))
    y = F.linear(h, w["w2"])
    dist.all_reduce(y, group=group)
    return y + w["b2"]


def mlp_sequence_parallel(group) -> torch.Tensor:
    """Megatron-style sequence parallelism: all-gather the sequence in, reduce-scatter out."""
    w, r, n = _shards(group), dist.get_rank(group), dist.get_world_size(group)
    s = TOKENS // n
    x_local = full_weights()["x"][r * s:(r + 1) * s].contiguous()
    x = torch.empty(TOKENS, HIDDEN)
    dist.all_gather_into_tensor(x, x_local, group=group)
    h = F.gelu(F.linear(x, w["w1"], w["b1"]))
    y = F.linear(h, w["w2"])
    out = torch.empty(s, HIDDEN)
    dist.reduce_scatter_tensor(out, y, group=group)
    return out + w["b2"]


def gelu_before_all_reduce(group) -> torch.Tensor:
    """The row-parallel output fed to gelu before its all-reduce."""
    w = _shards(group)
    y = F.linear(F.gelu(F.linear(w["x"], w["w1"], w["b1"])), w["w2"])
    z = F.gelu(y)  # BUG: non-linear on partial
    dist.all_reduce(z, group=group)
    return z


def all_reduce_twice(group) -> torch.Tensor:
    """An all-reduce of a value that an earlier all-reduce already completed."""
    y = mlp(group)
    dist.all_reduce(y, group=group)  # BUG: double count
    return y


def _context_parallel_tokens(group) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses and a padding mask, sharded on the sequence over the cp group."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    losses, mask = torch.arange(4.0 * n).sin().abs(), torch.ones(4 * n)
    mask[-3:] = 0
    return (sc.annotate(losses[r * 4:(r + 1) * 4].clone(), cp=sc.S(0)),
            sc.annotate(mask[r * 4:(r + 1) * 4].clone(), cp=sc.S(0)))


def cp_loss_divided_locally(group) -> torch.Tensor:
    """Each rank divides its masked loss sum by its own token count."""
    losses, mask = _context_parallel_tokens(group)
    local = (losses * mask).sum() / mask.sum()  # BUG: division by partial
    dist.all_reduce(local, group=group)
    return local


def cp_loss_sum_then_divide(group) -> torch.Tensor:
    """The correct form: all-reduce the sum and the count, then divide."""
    losses, mask = _context_parallel_tokens(group)
    total, count = (losses * mask).sum(), mask.sum()
    dist.all_reduce(total, group=group)
    dist.all_reduce(count, group=group)
    return total / count


def _vocab_log_probs(group) -> tuple[torch.Tensor, torch.Tensor]:
    """Vocab-parallel log-softmax of logits sharded on the vocabulary, and the nll loss."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    v = VOCAB // n
    logits_full, target = seeded(TOKENS, VOCAB, seed=5), torch.arange(TOKENS) % VOCAB
    logits = logits_full[:, r * v:(r + 1) * v]
    top = logits.amax(dim=-1, keepdim=True)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (logits - top).exp().sum(dim=-1, keepdim=True)
    dist.all_reduce(sum_exp, group=group)
    log_probs = logits - top - sum_exp.log()
    local_target = target - r * v
    outside = (local_target < 0) | (local_target >= v)
    picked = log_probs.gather(1, local_target.clamp(0, v - 1).unsqueeze(1)).squeeze(1)
    picked = torch.where(outside, 0.0, picked)
    dist.all_reduce(picked, group=group)
    return log_probs, -picked.mean()


def label_smoothing_mean_over_shard(group) -> torch.Tensor:
    """Label smoothing averaged over this rank's vocabulary shard, added to the full loss."""
    log_probs, nll = _vocab_log_probs(group)
    smooth = -log_probs.mean(dim=-1).mean()
    return 0.9 * nll + 0.1 * smooth  # BUG: mean over shard


def label_smoothing_summed(group) -> torch.Tensor:
    """The correct form: sum over the shard, all-reduce, divide by the full vocabulary."""
    log_probs, nll = _vocab_log_probs(group)
    smooth = -log_probs.sum(dim=-1).mean()
    dist.all_reduce(smooth, group=group)
    return 0.9 * nll + 0.1 * smooth / VOCAB


def _column_output(group) -> torch.Tensor:
    w = _shards(group)
    return F.linear(w["x"], w["w1"])


def bias_not_sharded(group) -> torch.Tensor:
    """The bias is the first FFN/tp entries of the full bias on every rank: not this rank's."""
    f = FFN // dist.get_world_size(group)
    bias = full_weights()["b1"][:f]
    return _column_output(group) + bias  # BUG: global shape mismatch


def bias_sliced_by_rank(group) -> torch.Tensor:
    """The correct form: each rank takes its own chunk of the replicated bias."""
    r, f = dist.get_rank(group), FFN // dist.get_world_size(group)
    bias = full_weights()["b1"][r * f:(r + 1) * f]
    return _column_output(group) + bias


def gather_on_the_global_group(tp_group, global_tp_group) -> torch.Tensor:
    """Data laid out on an explicit tp group, gathered on the global tp group (other ranks)."""
    y = _column_output(tp_group)
    out = torch.empty(2 * TOKENS, y.shape[1])
    dist.all_gather_into_tensor(out, y.t().contiguous(), group=global_tp_group)  # BUG: unknown axis
    return out


def gather_on_the_data_group(tp_group) -> torch.Tensor:
    """The correct form of the gather above."""
    y = _column_output(tp_group)
    out = torch.empty(2 * y.shape[1], TOKENS)
    dist.all_gather_into_tensor(out, y.t().contiguous(), group=tp_group)
    return out


def scatter_by_wrong_rank(index_group) -> torch.Tensor:
    """Scatter-to-region of a per-rank batch, indexed by the rank in ``index_group``."""
    batch = sc.annotate(torch.randn(4, HIDDEN), tp=sc.R, dp=sc.V)  # each rank's own data
    r, width = dist.get_rank(index_group), HIDDEN // dist.get_world_size(index_group)
    return batch[:, r * width:(r + 1) * width]  # BUG: split of varying


def varying_blocks_by_layer(group) -> torch.Tensor:
    """Each rank's own statistics, read block by block with a fixed index (no rank involved)."""
    stats, width = sc.annotate(torch.randn(4, HIDDEN), dp=sc.V), HIDDEN // 2
    return sum(stats[:, layer * width:(layer + 1) * width] for layer in range(2))


def varying_block_by_rank(group) -> torch.Tensor:
    """Each rank's own data, then its block by rank as if it were replicated."""
    stats, width = sc.annotate(torch.randn(4, HIDDEN), dp=sc.V), HIDDEN // 2
    r = dist.get_rank(group)
    return stats[:, r * width:(r + 1) * width]  # BUG: split of varying
