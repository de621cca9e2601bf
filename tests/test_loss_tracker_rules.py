"""A per-layer loss tracker, as Megatron's MoE aux-loss logging keeps it, on real Gloo ranks.

``values = zeros(num_layers); values[layer] += loss`` with the loss P over tp, then a SUM
all-reduce over tp. With as many layers as tp ranks, ``values[layer]`` picks, on one rank, the
element whose index is that rank's: the rank-slice heuristic must not read it as this rank's
chunk.
"""

import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

LAYERS = 2


def _tracked_losses(second_loss_reduced_first: bool):
    """Track two layers' partial losses; the bug adds an already-reduced second loss."""
    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    partials = [torch.tensor(1.0 + rank + 10 * layer) for layer in range(LAYERS)]
    expected = torch.tensor([sum(1.0 + r + 10 * layer for r in range(2)) for layer in range(LAYERS)])
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        for loss in partials:
            sc.annotate(loss, tp=sc.P)
        if second_loss_reduced_first:
            dist.all_reduce(partials[1], group=group)
        values = torch.zeros(LAYERS)
        types = []
        for layer, loss in enumerate(partials):
            values[layer] += loss.detach()
            types.append(repr(sc.typeof(values)))
        dist.all_reduce(values, group=group)
        types.append(repr(sc.typeof(values)))
        rules = [v.rule for v in sc.violations()]
    return types, rules, (values - expected).abs().max().item()


def _untyped_loss_tracked():
    """A layer whose loss the checker could not type (its input came in untyped)."""
    group = dist.new_group([0, 1])
    untyped_input = torch.rand(4)
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        values = torch.zeros(LAYERS)
        values[0] += sc.annotate(torch.tensor(1.0 + dist.get_rank()), tp=sc.P)
        scaled = untyped_input.sum() * 1e-2
        values[1] += scaled
        return repr(sc.typeof(scaled)), [v.rule for v in sc.violations()]


def test_an_untyped_loss_times_a_number_stays_unknown():
    for scaled, rules in spawn_ranks(_untyped_loss_tracked, 2):
        assert scaled == "{}"
        assert rules == []


def test_tracker_of_partial_losses_is_partial_then_replicated():
    for types, rules, error in spawn_ranks(_tracked_losses, 2, False):
        assert types == ["{'tp': P}", "{'tp': P}", "{'tp': R}"]
        assert rules == []
        assert error == 0.0


def test_a_reduced_loss_added_to_the_partial_tracker_is_flagged():
    for _, rules, error in spawn_ranks(_tracked_losses, 2, True):
        assert "affine on partial" in rules
        assert error > 1.0
