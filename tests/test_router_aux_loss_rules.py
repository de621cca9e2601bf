"""A MoE router's load-balancing loss under sequence parallelism, on real Gloo ranks.

Each rank routes its own tokens (S(0) over tp). The aux loss sums the router's softmax scores
over the tokens (P over tp); its gradient reaches the scores as the backward of that sum: the
replicated gradient of the sum expanded along the rank's own tokens, its rows of the global
gradient (S(0), as the summed scores). A replicated row expanded along the token dim (stride 0)
fits any token shard; a materialised full-size replicated operand combined with the shard stays
a global shape mismatch. The sequence-level aux loss views the scores ``[s, b * e]`` before that
sum: its gradient is S(0) there and viewed back ``[s * b, e]`` (checked on a types-only mesh, no
process); summed over the sequence it is a partial sum that needs an all-reduce over tp.
"""

import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks
from shardcheck.typecheck.broadcast import broadcast_blocks, fits_shard

TOKENS, HIDDEN, EXPERTS, TOPK = 16, 8, 4, 2
SEQ, BATCH = 8, 2  # TOKENS = SEQ * BATCH, sequence-major as Megatron flattens [s, b]


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


def _sequence_aux_gradient(gradient: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The router's softmax backward on a types-only tp mesh of 2 (this is rank 0). "seq aux
    loss": Megatron's sequence-level aux loss (scores viewed [s, b * e], summed over the
    sequence); otherwise the scores' gradient is given: "per position" (one replicated value per
    sequence position, the full sequence's rather than this rank's) or "full size" (replicated)."""
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1]), mode="collect"):
        logits = sc.annotate(torch.randn(TOKENS, EXPERTS, requires_grad=True), tp=sc.S(0))
        scores = torch.softmax(logits, dim=-1)
        types = {}
        if gradient == "seq aux loss":
            per_expert = sc.annotate(torch.rand(BATCH * EXPERTS), tp=sc.R)  # all-reduced counts
            aux = (scores.reshape(SEQ, -1).sum(0) * per_expert).sum() / BATCH
            aux.backward()
            types["aux"] = repr(sc.typeof(aux)["tp"])
        elif gradient == "per position":
            per_position = sc.annotate(torch.rand(SEQ, 1), tp=sc.R)
            scores.backward(per_position.expand(-1, BATCH * EXPERTS).reshape(TOKENS, EXPERTS))
        else:
            scores.backward(sc.annotate(torch.rand(TOKENS, EXPERTS), tp=sc.R))
        types["logits.grad"] = repr(sc.typeof(logits.grad)["tp"])
        rules = sorted({(v.rule, v.op) for v in sc.violations()})
    return types, rules


def test_sequence_aux_loss_gradient_fits_the_token_shard():
    assert _sequence_aux_gradient("seq aux loss") == ({"aux": "P", "logits.grad": "S(0)"}, [])


def _sequence_aux_loss_gradients(steps: int) -> list[dict[str, str]]:
    """Megatron's ``_apply_seq_aux_loss`` on this rank's tokens (types-only tp mesh of 2), run
    ``steps`` times in one region (a sum met again may be typed by its remembered outcome):
    the types of each step's gradients, and of their sums over the sequence."""
    found = []
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1]), mode="collect"):
        for _ in range(steps):
            logits = sc.annotate(torch.randn(TOKENS, EXPERTS, requires_grad=True), tp=sc.S(0))
            scores = torch.softmax(logits, dim=-1)
            per_sequence = scores.reshape(SEQ, -1)  # [s, b * e]
            for kept in (scores, per_sequence):
                kept.retain_grad()
            per_expert = sc.annotate(torch.rand(BATCH * EXPERTS), tp=sc.R)
            ((per_sequence.sum(0) * per_expert).sum() / BATCH).backward()
            found.append({name: repr(sc.typeof(t)["tp"]) for name, t in (
                ("[s, b * e] grad", per_sequence.grad), ("scores.grad", scores.grad),
                ("logits.grad", logits.grad), ("its sum over s", per_sequence.grad.sum(0)),
                ("scores.grad summed", scores.grad.sum(0)))})
        assert sc.violations() == []
    return found


def test_sequence_aux_loss_gradients_are_the_ranks_own_rows():
    expected = {"[s, b * e] grad": "S(0)", "scores.grad": "S(0)", "logits.grad": "S(0)",
                "its sum over s": "P", "scores.grad summed": "P"}
    assert _sequence_aux_loss_gradients(steps=2) == [expected, expected]


def test_a_sum_over_a_dim_no_axis_cuts_keeps_the_gradients_type():
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1]), mode="collect"):
        shard = sc.annotate(torch.randn(TOKENS, EXPERTS, requires_grad=True), tp=sc.S(0))
        replicated = sc.annotate(torch.randn(TOKENS, EXPERTS, requires_grad=True), tp=sc.R)
        (shard.sum(1) * sc.annotate(torch.rand(TOKENS), tp=sc.S(0))).sum().backward()
        replicated.sum(0).sum().backward()
        types = {"shard.grad": sc.typeof(shard.grad), "replicated.grad": sc.typeof(replicated.grad)}
        assert sc.violations() == []
    assert types == {"shard.grad": {"tp": sc.S(0)}, "replicated.grad": {"tp": sc.R}}


def _summed_scores_gradient(all_reduced: bool):
    """A bias on the router's scores under the sequence-level aux loss, on real Gloo ranks: its
    gradient sums the scores' gradient over this rank's tokens (P over tp), so a step with it
    needs the all-reduce first. Returns the findings and the step's error against one rank."""
    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    tokens, weight, _ = _global_inputs()

    def step(x, bias, per_expert, reduce: bool):
        scores = torch.softmax(x @ weight, dim=-1) + bias
        aux = (scores.reshape(x.shape[0] // BATCH, -1).sum(0) * per_expert).sum() / BATCH
        aux.backward()
        grad = bias.grad
        if reduce:
            dist.all_reduce(grad, group=group)
        return bias.detach() - 0.1 * grad

    per_expert = torch.arange(BATCH * EXPERTS, dtype=torch.float32)  # counts, all-reduced
    start = torch.rand(EXPERTS, generator=torch.Generator().manual_seed(1))
    reference = step(tokens, start.clone().requires_grad_(), per_expert, False)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        x = sc.annotate(tokens[mine].clone(), tp=sc.S(0))
        bias = sc.annotate(start.clone().requires_grad_(), tp=sc.R)
        sc.annotate(weight, tp=sc.R)
        updated = step(x, bias, sc.annotate(per_expert, tp=sc.R), all_reduced)
        rules = sorted({(v.rule, v.op) for v in sc.violations()})
    return rules, (updated - reference).abs().max().item()


def _summed_scores_gradient_both_ways():
    return {reduced: _summed_scores_gradient(reduced) for reduced in (False, True)}


def test_a_sum_of_the_sequence_aux_gradient_needs_an_all_reduce_over_tp():
    for by_reduce in spawn_ranks(_summed_scores_gradient_both_ways, 2):
        rules, error = by_reduce[False]
        assert rules == [("affine on partial", "aten.sub.Tensor")] and error > 1e-4
        rules, error = by_reduce[True]
        assert rules == [] and error < 1e-6


def test_replicated_gradient_of_the_whole_sequence_is_still_flagged():
    for gradient in ("per position", "full size"):
        types, rules = _sequence_aux_gradient(gradient)
        assert rules == [("global shape mismatch", "aten._softmax_backward_data.default")]
        assert types == {"logits.grad": "V"}


def test_rows_repeating_fit_a_shard_whose_pieces_are_whole_repeats():
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1])):  # the checker tags what ops make
        repeated = torch.randn(1, BATCH * EXPERTS).expand(SEQ, -1).reshape(TOKENS, EXPERTS)
        in_blocks = torch.randn(SEQ, 1).expand(-1, BATCH * EXPERTS).reshape(TOKENS, EXPERTS)
    assert broadcast_blocks(repeated) == {-2: (1, BATCH)}  # one value every BATCH rows
    assert fits_shard(repeated, 0) and fits_shard(repeated, 0, TOKENS // BATCH)
    assert not fits_shard(repeated, 0, TOKENS)  # pieces of one row: not whole repeats
    assert broadcast_blocks(in_blocks) == {-2: (SEQ, 1), -1: (1, 1)}
    assert fits_shard(in_blocks, 0, SEQ) and not fits_shard(in_blocks, 0)
