"""Rows routed to experts sharded over ep by Megatron's uneven all-to-all, on real Gloo ranks.

Each rank routes its own tokens (V over ep: data-parallel samples) to 4 experts, 2 per rank,
with Megatron's permute, all_to_all, sort_chunks_by_idxs and unpermute, each row scaled by its
probability (picked by the rank's own routing map with masked_select, as megatron-core 0.16's
permute does, and routed alongside). Correctly routed, every token of an expert reaches its
rank: the expert weights' gradients are complete (S(0) on ep, as declared) and equal the
one-rank ones. Kept local (no all-to-all), sent by splits that cut across the experts, or
all-reduced over ep after the step's backward, they are not, the numbers differ from one rank,
and the checker says so; so it does where the probabilities are left in the order they arrived
(each row scaled by another row's probability).
"""

import pytest
import torch
import torch.distributed as dist
from moe_values import moe_values

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

pytest.importorskip("megatron.core")

TOKENS, HIDDEN, EXPERTS, LOCAL = 12, 4, 4, 2
UNREDUCED = "unreduced gradient"


def _values():
    return moe_values(2 * TOKENS, HIDDEN, EXPERTS, seed=0)


def _routing_map(tokens: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """Top-2 routing of each token: a [tokens, experts] bool map."""
    top = (tokens @ router).topk(2, dim=1).indices
    return torch.zeros(tokens.shape[0], EXPERTS, dtype=torch.bool).scatter(1, top, True)


def _experts(rows: torch.Tensor, counts: list[int], weights) -> torch.Tensor:
    return torch.cat([torch.tanh(chunk @ w) for chunk, w in zip(rows.split(counts), weights, strict=True)])


def _probs(tokens: torch.Tensor, router: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """Each token's softmax over its routed experts' scores, zero elsewhere: [tokens, experts]."""
    return (tokens @ router).masked_fill(~routing_map, float("-inf")).softmax(-1)


def _moe(variant: str, tokens, probs, routing_map, weights, group, n: int, k: int) -> torch.Tensor:
    """Megatron's alltoall dispatch, the local experts, and the combine."""
    from megatron.core.tensor_parallel.mappings import all_to_all
    from megatron.core.transformer.moe.moe_utils import permute, sort_chunks_by_idxs, unpermute

    counts = routing_map.sum(0)
    permuted, _, indices = permute(tokens, routing_map, num_out_tokens=int(counts.sum()))[:3]
    picks = probs.T.contiguous().masked_select(routing_map.T.contiguous())
    everyone = [torch.zeros_like(counts) for _ in range(n)]
    dist.all_gather(everyone, counts, group=group)
    if variant == "local":  # each rank's own tokens of its experts only: no all-to-all
        start, end = int(counts[:k * LOCAL].sum()), int(counts[:(k + 1) * LOCAL].sum())
        done = _experts(permuted[start:end] * picks[start:end, None], counts[k * LOCAL:(k + 1) * LOCAL].tolist(), weights)
        out = torch.cat([torch.zeros_like(permuted[:start]), done, torch.zeros_like(permuted[end:])])
        return unpermute(out, indices, restore_shape=tokens.shape, routing_map=routing_map)
    per_rank = [c.view(n, LOCAL) for c in everyone]
    if variant == "across":  # the splits group the experts as e % n: blocks cut across them
        per_rank = [c.view(LOCAL, n).T for c in everyone]
    table = torch.stack([c[k] for c in per_rank])  # [source, local expert]
    sent, received = per_rank[k].sum(1).tolist(), table.sum(1).tolist()
    arrived = all_to_all(group, permuted, received, sent)
    arrived_picks = all_to_all(group, picks, received, sent)
    by_expert, sorted_picks = sort_chunks_by_idxs(arrived, table.ravel(), torch.arange(n * LOCAL).view(n, LOCAL).T.ravel(),
                                                  probs=arrived_picks)
    if variant == "unsorted_probs":  # the probabilities in the order they arrived, not by expert
        sorted_picks = arrived_picks
    done = _experts(by_expert * sorted_picks[:, None], table.sum(0).tolist(), weights)
    back, _ = sort_chunks_by_idxs(done, table.T.ravel(), torch.arange(n * LOCAL).view(LOCAL, n).T.ravel())
    returned = all_to_all(group, back, sent, received)
    return unpermute(returned, indices, restore_shape=tokens.shape, routing_map=routing_map)


def _routed(variant: str):
    from shardcheck.megatron.cpu.patches import apply_cpu_patches

    apply_cpu_patches()  # Megatron's all_to_all allocates on torch.cuda.current_device()
    group, k = dist.new_group([0, 1]), dist.get_rank()
    tokens, router, experts = _values()
    weights = [experts[k * LOCAL + i].clone().requires_grad_() for i in range(LOCAL)]
    with sc.typecheck(sc.Mesh(ep=group), mode="collect"):
        mine = sc.annotate(tokens.chunk(2)[k].clone(), ep=sc.V)
        route = sc.annotate(router.clone(), ep=sc.R)
        sc.annotate_parameters({f"expert{i}": w for i, w in enumerate(weights)}, ep=sc.S(0))
        routing_map = _routing_map(mine, route)
        out = _moe(variant, mine, _probs(mine, route, routing_map), routing_map, weights, group, 2, k)
        (out * out).sum().backward()
        if variant == "reduced_twice":  # summed over ep as a dense gradient would be
            for w in weights:
                dist.all_reduce(w.grad, group=group)
        sc.check_gradients({f"expert{i}": w for i, w in enumerate(weights)})
        types = [repr(sc.typeof(w.grad).get("ep")) for w in weights]
        found = sorted({v.rule for v in sc.violations()})
    return types, found, [w.grad.clone() for w in weights]


def _one_rank() -> list[torch.Tensor]:
    """Every expert's weight gradient with all tokens on one rank."""
    tokens, router, experts = _values()
    weights = [experts[e].clone().requires_grad_() for e in range(EXPERTS)]
    routing_map = _routing_map(tokens, router)
    probs = _probs(tokens, router, routing_map)
    out = torch.zeros_like(tokens)
    for e, w in enumerate(weights):
        picked = routing_map[:, e]
        out[picked] += torch.tanh(tokens[picked] * probs[picked, e].unsqueeze(-1) @ w)
    (out * out).sum().backward()
    return [w.grad for w in weights]


def _matches_one_rank(ranks) -> bool:
    expected = _one_rank()
    return all(torch.allclose(grad, expected[k * LOCAL + i])
               for k, (_, _, grads) in enumerate(ranks) for i, grad in enumerate(grads))


@pytest.mark.slow
def test_expert_gradients_of_rows_routed_to_their_ranks_are_complete():
    ranks = spawn_ranks(_routed, 2, "correct", timeout=300)
    assert [r[:2] for r in ranks] == [(["S(0)", "S(0)"], [])] * 2
    assert _matches_one_rank(ranks)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["local", "across", "reduced_twice"])
def test_expert_gradients_of_rows_not_routed_to_their_ranks_are_found(variant):
    ranks = spawn_ranks(_routed, 2, variant, timeout=300)
    assert all(r[0] == ["V", "V"] and UNREDUCED in r[1] for r in ranks), [r[:2] for r in ranks]
    assert not _matches_one_rank(ranks)


@pytest.mark.slow
def test_probabilities_not_sorted_like_their_routed_rows_are_found():
    ranks = spawn_ranks(_routed, 2, "unsorted_probs", timeout=300)
    assert all("mixed shards" in r[1] for r in ranks), [r[:2] for r in ranks]
    assert not _matches_one_rank(ranks)


def _route() -> tuple:
    from shardcheck.typecheck.types import Route, Routed

    route = Route(table=((3, 0), (2, 4)), sent=(5, 4), grouping=("rows",))  # rank 0 sent no rows of group 1
    return route, Routed(0, route, route.received, sc.V)


def test_routed_parts_cut_at_their_bounds_and_complete_per_group():
    from shardcheck.typecheck.types import joined

    route, rows = _route()
    assert rows.parts == ((0, 0), (1, 0), (1, 1))
    group0, group1 = rows.piece(0, 5), rows.piece(5, 4)
    assert group0.parts == ((0, 0), (1, 0)) and group0.complete() and group1.complete()
    assert rows.piece(0, 4) is None and not rows.complete()  # inside a part; two groups
    assert not rows.piece(0, 3).complete()  # group 0 without rank 1's rows
    assert not joined([group0, group0], 0).complete()  # rank 0's and 1's rows twice
    assert joined([group1, group0], 0).parts == ((1, 1), (0, 0), (1, 0))


def test_a_contraction_over_routed_rows_is_complete_only_over_one_group_s_every_part():
    from shardcheck.typecheck.rules.contraction import _routed_contract

    route, rows = _route()
    group0 = rows.piece(0, 5)
    assert _routed_contract([group0.at(1), group0], ["mk", "kn"], "mn") == sc.S(0)  # dW = dy^T x
    assert _routed_contract([rows.at(1), rows], ["mk", "kn"], "mn") == sc.P  # two groups summed
    assert _routed_contract([group0, sc.S(0)], ["nk", "km"], "nm") == group0  # x @ W of the rank's group
    assert _routed_contract([group0, sc.R], ["nk", "km"], "nm") == group0
    assert _routed_contract([group0, sc.V], ["nk", "km"], "nm") == sc.V
    assert _routed_contract([group0.at(1), rows.piece(5, 4)], ["mk", "kn"], "mn") == sc.V  # other rows
