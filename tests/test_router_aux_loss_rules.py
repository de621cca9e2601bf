"""A MoE router's load-balancing loss under sequence parallelism, on real Gloo ranks.

Each rank routes its own tokens (S(0) over tp). The aux loss sums the router's softmax scores
over the tokens (P over tp); its gradient reaches the scores as the backward of that sum: a
replicated row expanded along the token dim (stride 0), which fits any token shard. A
materialised full-size replicated operand combined with the shard stays a global shape
mismatch.
"""

import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

TOKENS, HIDDEN, EXPERTS, TOPK = 16, 8, 4, 2


def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def _aux_loss(tokens: torch.Tensor, weight: torch.Tensor, group, token_weights=None,
              score_function: str = "softmax"):
    """Switch-style load-balancing loss of ``tokens`` (this rank's, or all of them)."""
    logits = tokens @ weight
    scores = _scores(logits, score_function)
    if token_weights is not None:
        scores = scores * token_weights
    routed = torch.zeros_like(logits).scatter(1, logits.topk(TOPK, dim=-1).indices, 1.0)
    per_expert = routed.sum(dim=0)
    if group is not None:
        dist.all_reduce(per_expert, group=group)
    return (scores.sum(dim=0) * per_expert).sum() * 1e-2


def _global_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(2 * TOKENS, HIDDEN, generator=gen)
    return tokens, torch.randn(HIDDEN, EXPERTS, generator=gen), torch.rand(2 * TOKENS, EXPERTS,
                                                                           generator=gen)


def _router_step(with_wrong_token_weights: bool, score_function: str = "softmax"):
    """One aux-loss backward; returns the findings, the types and the gradient's error."""
    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    tokens, weight, token_weights = _global_inputs()
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    # The bug: every rank weights its tokens with the first rank's rows, not its own.
    wrong_weights = token_weights[:TOKENS] if with_wrong_token_weights else None
    reference = weight.clone().requires_grad_()
    _aux_loss(tokens, reference, None, token_weights if with_wrong_token_weights else None,
              score_function).backward()
    local = weight.clone().requires_grad_()
    x = tokens[mine].clone().requires_grad_()
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        sc.annotate(x, tp=sc.S(0))
        sc.annotate(local, tp=sc.R)
        if wrong_weights is not None:
            sc.annotate(wrong_weights, tp=sc.R)
        loss = _aux_loss(x, local, group, wrong_weights, score_function)
        loss.backward()
        types = {"loss": repr(sc.typeof(loss)["tp"]), "x.grad": repr(sc.typeof(x.grad)["tp"]),
                 "weight.grad": repr(sc.typeof(local.grad)["tp"])}
        rules = sorted({(v.rule, v.op) for v in sc.violations()})
    grad = local.grad.clone()
    dist.all_reduce(grad, group=group)
    return rules, types, (grad - reference.grad).abs().max().item()


def _router_steps_of_both_score_functions():
    return {score: _router_step(False, score) for score in ("softmax", "sigmoid")}


def _broadcast_rows_times_shard():
    """The gradient pattern alone: replicated rows, one value along the token dim, against a
    token shard; materialised with a full-size operand or written to, they are no broadcast."""
    group = dist.new_group([0, 1])
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        shard = sc.annotate(torch.randn(TOKENS, EXPERTS), tp=sc.S(0))
        row = sc.annotate(torch.randn(1, EXPERTS), tp=sc.R)
        expanded = row.expand(TOKENS, EXPERTS)
        negated = -expanded
        types = {"expanded * shard": repr(sc.typeof(expanded * shard)["tp"]),
                 "negated * shard": repr(sc.typeof(negated * shard)["tp"])}
        full = expanded + sc.annotate(torch.randn(TOKENS, EXPERTS), tp=sc.R)
        full * shard
        negated[0] += 1.0
        negated * shard
        rules = [v.rule for v in sc.violations()]
    return types, rules


def test_aux_loss_gradient_through_the_router_scores_is_clean():
    for per_score in spawn_ranks(_router_steps_of_both_score_functions, 2):
        for rules, types, error in per_score.values():
            assert rules == []
            assert types == {"loss": "P", "x.grad": "S(0)", "weight.grad": "P"}
            assert error < 1e-6


def test_wrong_token_weights_are_still_flagged():
    for rules, _, error in spawn_ranks(_router_step, 2, True):
        assert ("global shape mismatch", "aten.mul.Tensor") in rules
        assert error > 1e-4


def test_broadcast_rows_fit_a_shard_until_materialised_or_written():
    for types, rules in spawn_ranks(_broadcast_rows_times_shard, 2):
        assert types == {"expanded * shard": "S(0)", "negated * shard": "S(0)"}
        assert rules == ["global shape mismatch"] * 2
