"""Rows a rank picks for its own experts from tokens every rank holds (Megatron's allgather
dispatcher), on real Gloo ranks against one rank.

Each rank gathers every rank's tokens over ep, cuts the routing map to its 2 local experts of
4, permutes, runs its experts, unpermutes and reduce-scatters back, as the dispatcher does.
Every token of an expert is then on the expert's rank: the expert weights' gradients are
complete (S(0) on ep, as declared) and, with the router's, equal the one-rank ones. Picked
from the rank's own tokens only, or all-reduced over ep after the backward, they are not, the
numbers differ from one rank, and the checker says so (at the cut of the rank's own map by
the ep rank; at the gradients).
"""

import pytest
import torch
import torch.distributed as dist
from moe_values import moe_values

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

pytest.importorskip("megatron.core")

TOKENS, HIDDEN, EXPERTS, LOCAL = 6, 4, 4, 2
MISMATCH = "gradient type mismatch"


def _values():
    return moe_values(2 * TOKENS, HIDDEN, EXPERTS, seed=1)


def _routing(tokens: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 routing: the [tokens, experts] bool map and the router's probabilities."""
    probs = torch.softmax(tokens @ router, dim=1)
    top = probs.detach().topk(2, dim=1).indices
    return torch.zeros_like(probs, dtype=torch.bool).scatter(1, top, True), probs


def _moe(variant: str, mine, router, weights, group, k: int) -> torch.Tensor:
    """Megatron's allgather dispatch (0.19's dispatch_postprocess), the local experts, combine."""
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    gathered = variant != "own tokens"
    tokens = gather_from_sequence_parallel_region(mine, group=group) if gathered else mine
    routing_map, probs = _routing(tokens, router)
    local_map = routing_map[:, k * LOCAL:(k + 1) * LOCAL].contiguous()
    local_probs = probs[:, k * LOCAL:(k + 1) * LOCAL].contiguous()
    counts = local_map.sum(dim=0)
    permuted, _, indices = permute(tokens, local_map, num_out_tokens=int(counts.sum()))[:3]
    picked_probs = local_probs.T.contiguous().masked_select(local_map.T.contiguous())
    rows = [torch.tanh(chunk @ w) for chunk, w in zip(permuted.split(counts.tolist()), weights, strict=True)]
    done = torch.cat(rows) * picked_probs.unsqueeze(-1)
    out = unpermute(done, indices, restore_shape=tokens.shape, routing_map=local_map)
    return reduce_scatter_to_sequence_parallel_region(out, group=group) if gathered else out


def _picked(variant: str):
    from shardcheck.megatron.cpu.patches import apply_cpu_patches

    apply_cpu_patches()  # Megatron's mappings allocate on torch.cuda.current_device()
    group, k = dist.new_group([0, 1]), dist.get_rank()
    tokens, router, experts = _values()
    weights = [experts[k * LOCAL + i].clone().requires_grad_() for i in range(LOCAL)]
    route = router.clone().requires_grad_()
    params = {**{f"expert{i}": w for i, w in enumerate(weights)}, "router": route}
    with sc.typecheck(sc.Mesh(ep=group), mode="collect"):
        mine = sc.annotate(tokens.chunk(2)[k].clone(), ep=sc.V)
        sc.annotate_parameters({f"expert{i}": w for i, w in enumerate(weights)}, ep=sc.S(0))
        sc.annotate_parameters({"router": route}, ep=sc.R)
        out = _moe(variant, mine, route, weights, group, k)
        (out * out).sum().backward()
        if variant == "reduced_twice":  # summed over ep as a dense gradient would be
            for w in weights:
                dist.all_reduce(w.grad, group=group)
        dist.all_reduce(route.grad, group=group)  # the router is dense: DDP sums its gradient
        sc.check_gradients(params)
        types = {name: repr(sc.typeof(p.grad).get("ep")) for name, p in params.items()}
        found = sorted({v.rule for v in sc.violations()})
    return types, found, [w.grad.clone() for w in weights], route.grad.clone()


def _one_rank():
    """Every expert's and the router's gradient with all tokens on one rank."""
    tokens, router, experts = _values()
    weights = [experts[e].clone().requires_grad_() for e in range(EXPERTS)]
    route = router.clone().requires_grad_()
    routing_map, probs = _routing(tokens, route)
    out = torch.zeros_like(tokens)
    for e, w in enumerate(weights):
        picked = routing_map[:, e]
        out[picked] += torch.tanh(tokens[picked] @ w) * probs[picked, e].unsqueeze(-1)
    (out * out).sum().backward()
    return [w.grad for w in weights], route.grad


def _matches_one_rank(ranks) -> bool:
    experts, router = _one_rank()
    return all(torch.allclose(grad, experts[k * LOCAL + i]) and torch.allclose(rank[3], router)
               for k, rank in enumerate(ranks) for i, grad in enumerate(rank[2]))


@pytest.mark.slow
def test_expert_gradients_of_rows_picked_from_every_ranks_tokens_are_complete():
    ranks = spawn_ranks(_picked, 2, "correct", timeout=300)
    expected = {"expert0": "S(0)", "expert1": "S(0)", "router": "R"}
    assert [r[:2] for r in ranks] == [(expected, [])] * 2
    assert _matches_one_rank(ranks)


@pytest.mark.slow
@pytest.mark.parametrize("variant, found", [
    ("own tokens", ["split of varying"]),  # the rank's own tokens' map cut by the ep rank
    ("reduced_twice", [MISMATCH]),
])
def test_expert_gradients_of_rows_picked_otherwise_are_found(variant, found):
    ranks = spawn_ranks(_picked, 2, variant, timeout=300)
    assert all(r[1] == found for r in ranks), [r[:2] for r in ranks]
    assert not _matches_one_rank(ranks)
