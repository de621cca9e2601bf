"""The MoE alltoall dispatcher's token counts on 2 real Gloo ranks (tp2 with sequence
parallelism): each rank counts the tokens per expert of its own sequence shard (a partial
count) and gathers every rank's count over tp. Collecting the pieces is correct and typed so;
planted, the counts summed over tp before the gather are flagged and really wrong."""

import pytest
import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.slow]

TOKENS, EXPERTS, TOPK = 8, 4, 2


def _routing_map() -> torch.Tensor:
    scores = torch.rand(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(3))
    return torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, scores.topk(TOPK).indices, True)


def _summed_before_gather(gather):
    """The planted bug: each rank's count all-reduced over the group, then gathered."""
    def gather_summed(input_, group=None, **kwargs):
        input_ = input_.clone()
        dist.all_reduce(input_, group=group)
        return gather(input_, group=group, **kwargs)
    return gather_summed


def _dispatcher_counts(planted: bool):
    from shardcheck.megatron.cpu.patches import apply_cpu_patches

    apply_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import token_dispatcher

    from shardcheck.megatron.checks import contracts

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    contracts.install()
    if planted:
        token_dispatcher.gather_from_sequence_parallel_region = _summed_before_gather(
            token_dispatcher.gather_from_sequence_parallel_region)
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=TOPK, tensor_model_parallel_size=2, sequence_parallel=True,
        moe_token_dispatcher_type="alltoall", use_cpu_initialization=True, add_bias_linear=False)
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher(
        EXPERTS, list(range(EXPERTS)), config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    shard = TOKENS // 2
    rank = ps.get_tensor_model_parallel_rank()
    local = _routing_map()[rank * shard:(rank + 1) * shard].clone()
    with sc.typecheck(sc.Mesh(tp=ps.get_tensor_model_parallel_group()), mode="collect"):
        tokens_per_expert = dispatcher.preprocess(sc.annotate(local, tp=sc.S(0)))
        found = {"counts": tokens_per_expert.tolist(), "type": repr(sc.typeof(tokens_per_expert)),
                 "rules": sorted({v.rule for v in sc.violations()})}
    ps.destroy_model_parallel()
    return found


def test_gathering_every_ranks_partial_count_is_correct_and_typed():
    expected = _routing_map().sum(dim=0).tolist()
    for found in spawn_ranks(_dispatcher_counts, 2, False):
        assert found == {"counts": expected, "type": "{'tp': R}", "rules": []}


def test_counts_summed_over_tp_before_the_gather_are_flagged_and_wrong():
    doubled = (2 * _routing_map().sum(dim=0)).tolist()
    for found in spawn_ranks(_dispatcher_counts, 2, True):
        assert found["counts"] == doubled
        assert found["rules"] == ["contract", "gather of replicated"]
