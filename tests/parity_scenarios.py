"""Plain torch.distributed scenarios for the parity tests: a TP/SP/CP/DP MLP block, and planted bugs.

One block, written once for every layout: a replicated norm, a column-parallel fc1, gelu, a
row-parallel fc2 (all-reduce, or reduce-scatter over the sequence with sp), a residual, a mean
pool over the sequence (which cp splits) and a loss. The batch is split over dp, the sequence
over cp (and over tp with sp). Gradients are summed over dp x cp after backward.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from grad_programs import CopyToRegion, ReduceFromRegion
from torch import nn

import shardcheck as sc
from shardcheck.parity.scenario import build_groups

B, S, H, FF = 4, 8, 6, 12


class _Gather(torch.autograd.Function):
    """All-gather along ``dim`` forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _Gather.apply(grad, ctx.group, ctx.dim), None, None


class ColumnParallel(nn.Module):
    def __init__(self, ctx, weight, local_scale_bug=False):
        super().__init__()
        self.weight = nn.Parameter(ctx.shard(weight, sc.S(0), "tp"))
        width = self.weight.shape[0] if local_scale_bug else weight.shape[0]
        self.scale = 1 / math.sqrt(width)

    def forward(self, x):
        return F.linear(x, self.weight) * self.scale


class RowParallel(nn.Module):
    def __init__(self, ctx, weight, sp, scale=1.0):
        super().__init__()
        self.weight = nn.Parameter(ctx.shard(weight, sc.S(1), "tp"))
        self.group, self.sp, self.scale = ctx.groups["tp"], sp, scale

    def forward(self, x):
        partial = F.linear(x, self.weight) * self.scale
        return _ReduceScatter.apply(partial, self.group, 1) if self.sp else ReduceFromRegion.apply(partial, self.group)


class MeanPool(nn.Module):
    """Mean over the sequence, split in equal shards over cp (and tp with sp): the average of local means."""

    def __init__(self, ctx, count_bug=False):
        super().__init__()
        self.groups = [ctx.groups["cp"]] + ([ctx.groups["tp"]] if ctx.layout.sp else [])
        self.shards = ctx.layout.cp * (ctx.layout.tp if ctx.layout.sp else 1)
        self.count_bug = count_bug

    def forward(self, y):
        count = torch.tensor(float(y.shape[1]))
        if self.count_bug:  # the count is all-reduced in place before its local use
            dist.all_reduce(count, group=self.groups[0])
        mean = y.sum(1) / count
        for group in self.groups:
            mean = ReduceFromRegion.apply(mean, group)
        return mean / self.shards


class Dropout(nn.Module):
    """Dropout whose mask is drawn for the global batch and sliced to this rank's tokens."""

    def __init__(self, ctx, p=0.25, seed_bug=False):
        super().__init__()
        self.ctx, self.p = ctx, p
        self.seed = 11 + (ctx.rank if seed_bug else 0)  # the bug: a seed that differs per rank

    def forward(self, y):
        generator = torch.Generator().manual_seed(self.seed)
        keep = (torch.rand(B, S, H, generator=generator) > self.p).float() / (1 - self.p)
        return y * _local_batch(self.ctx, keep)


class Block(nn.Module):
    def __init__(self, ctx, bug=None):
        super().__init__()
        gamma = 1 + 0.1 * torch.randn(H)
        torch.manual_seed(7)
        w1, w2 = torch.randn(FF, H), torch.randn(H, FF) * 0.3
        self.norm = nn.LayerNorm(H, elementwise_affine=False)
        self.gamma = nn.Parameter(sc.replicate(gamma))
        self.fc1 = ColumnParallel(ctx, w1, local_scale_bug=bug == "scale")
        self.act = nn.GELU()
        scale = 1 + 1e-3 if bug == "tiny" and ctx.world_size > 1 else 1.0
        self.fc2 = RowParallel(ctx, w2, ctx.layout.sp, scale)
        if bug == "global_group":  # reduces over the default-order tp group, not the layout's
            default = sc.Layout(tp=ctx.layout.tp, cp=ctx.layout.cp, dp=ctx.layout.dp)
            self.fc2.group = build_groups(default, ctx.rank)["tp"]
        self.drop = Dropout(ctx, seed_bug=bug == "seed")
        self.pool = MeanPool(ctx, count_bug=bug == "count")
        self.tp, self.sp = ctx.groups["tp"], ctx.layout.sp

    def forward(self, x):
        h = self.norm(x) * self.gamma
        h = _Gather.apply(h, self.tp, 1) if self.sp else CopyToRegion.apply(h, self.tp)
        y = x + self.drop(self.fc2(self.act(self.fc1(h))))
        return self.pool(y)


def _local_batch(ctx, x):
    x = sc.shard(sc.shard(x, sc.S(0), "dp"), sc.S(1), "cp")
    return sc.shard(x, sc.S(1), "tp") if ctx.layout.sp else x


def run_block(ctx, bug=None):
    """Build the block, run forward and backward, sum gradients over dp x cp; return named outputs."""
    torch.manual_seed(0)
    x = torch.randn(B, S, H)
    target = torch.randn(B, H)
    drop_type = sc.S(1) if ctx.layout.sp else sc.R
    block = ctx.register(Block(ctx, bug), prefix="block", types={"drop": {"tp": drop_type}})
    pooled = block(_local_batch(ctx, x))
    loss_sum = ((pooled - sc.shard(target, sc.S(0), "dp")) ** 2).sum()
    loss = ReduceFromRegion.apply(loss_sum, ctx.groups["dp"]) / (B * H)  # SUM then divide, never AVG
    loss.backward()
    for param in block.parameters():
        dist.all_reduce(param.grad, group=ctx.groups["dp_cp"])
    if ctx.layout.sp:
        dist.all_reduce(block.gamma.grad, group=ctx.groups["tp"])
    return {"loss": ctx.declare(loss.detach(), tp=sc.R, cp=sc.R, dp=sc.R), "pooled": pooled.detach()}


def correct(ctx):
    return run_block(ctx)


def count_bug(ctx):
    return run_block(ctx, "count")


def seed_bug(ctx):
    return run_block(ctx, "seed")


def scale_bug(ctx):
    return run_block(ctx, "scale")


def tiny_bug(ctx):
    return run_block(ctx, "tiny")


def global_group_bug(ctx):
    return run_block(ctx, "global_group")


def compared_clean(result, layouts) -> bool:
    """A parity result that says "no finding" because it compared: every layout asked for ran,
    each compared values (an empty or all-skipped report is no evidence) and none diverged."""
    reports = [str(report.layout) for report in result.reports]
    return (reports == [str(sc.Layout.coerce(layout)) for layout in layouts] and result.ok
            and all(any(row.verdict == "ok" for row in report.rows) for report in result.reports))
