"""The MoE TopKRouter's forward and backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import router as router_module
from megatron.core.transformer.moe.router import TopKRouter

from shardcheck.megatron.repro.parts.base import config_for
from shardcheck.megatron.repro.parts.pieces import gather
from shardcheck.megatron.repro.parts.script import SETUP
from shardcheck.megatron.repro.parts.seeded import seeded
from shardcheck.megatron.repro.parts.shard import shard


def run(sizes, pg):
    """TopKRouter forward and backward: [summed local_num_tokens, weight grad, input grad]."""
    def tokens(tensor):  # this rank's tokens: its CP chunk of the sequence, then its SP share
        return shard(tensor.chunk(pg.cp.size())[pg.cp.rank()], sizes, pg.tp)
    config = config_for(sizes, num_moe_experts=SETUP["experts"], moe_router_topk=SETUP["topk"],
                        moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="aux_loss",
                        add_bias_linear=False)
    router = TopKRouter(config, pg, **SETUP.get("model_args", {}))
    router.weight.data.copy_(seeded("router", SETUP["experts"], SETUP["hidden"]) * 0.05)
    seq, batch = SETUP["seq"], SETUP["batch"]
    local = tokens(seeded("tokens", seq, batch, SETUP["hidden"])).requires_grad_(True)
    padding = torch.zeros(seq, batch, dtype=torch.bool)  # True marks padding, uneven over ranks
    padding[seq * 5 // 8:, 0] = padding[seq - 1:, 1] = SETUP["padding"]
    counts = []  # the local token count megatron's router computes, recorded as it is returned

    def recorded(*args, **kwargs):
        result = counting(*args, **kwargs)
        counts.append(torch.as_tensor(result[1], dtype=torch.float32).clone())
        return result
    counting, router_module.get_tokens_per_expert_and_token_count = (
        router_module.get_tokens_per_expert_and_token_count, recorded)
    try:
        probs, _ = router(local, padding_mask=tokens(padding) if SETUP["padding"] else None)
    finally:
        router_module.get_tokens_per_expert_and_token_count = counting
    upstream = seeded("upstream", seq, batch, SETUP["experts"]).reshape(seq, -1)
    (probs * tokens(upstream).reshape(probs.shape)).sum().backward()
    dist.all_reduce(router.weight.grad, group=pg.cp)  # DDP's average over CP of a loss scaled by cp
    dist.all_reduce(router.weight.grad, group=pg.tp)  # finalize_model_grads' sequence-parallel sum
    count = torch.stack(counts).sum().view(1) if counts else torch.zeros(1)
    dist.all_reduce(count, group=pg.tp_cp)
    grad_in = gather(gather(local.grad, 0, pg.tp) if sizes["sp"] else local.grad, 0, pg.cp)
    return torch.cat([count, router.weight.grad.flatten(), grad_in.flatten()])
