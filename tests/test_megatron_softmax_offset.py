"""The learnable softmax offset under TP: each rank holds its own heads' offsets, yet Megatron's
metadata calls the parameter a TP duplicate, so its gradient norm counts tp rank 0's heads only.
The checker types the parameter from its sharded_state_dict cut (S over tp) and flags where the
gradient norm's duplicate test takes it for a replica (``shard counted as replica``, see
tests/test_megatron_step_and_stage_types.py): a true positive, not a rule bug."""

import pytest
import torch

pytest.importorskip("megatron.core")

from shardcheck.megatron.cpu.runner import run_ranks  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
HEADS = 4


def _duplicate_flags(ctx) -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from shardcheck.megatron.cpu.parallel import megatron_parallel
    from shardcheck.megatron.scenarios.gpt import GPTSetup, build_gpt, transformer_config

    def counted(group):
        return torch.tensor([float(param_is_not_tensor_parallel_duplicate(p)) for p in group])

    setup = GPTSetup(heads=HEADS, config={"softmax_type": "learnable"})
    with megatron_parallel(ctx):
        params = dict(build_gpt(transformer_config(ctx.layout, setup), setup).named_parameters())
        offsets = [p for name, p in params.items() if name.endswith("softmax_offset")]
        qkv = [p for name, p in params.items() if name.endswith("linear_qkv.weight")]
        return {"offset_sizes": torch.tensor([p.numel() for p in offsets]),
                "offset_marked_sharded": torch.tensor(
                    [float(getattr(p, "tensor_model_parallel", False)) for p in offsets]),
                "offset_counted": counted(offsets), "qkv_counted": counted(qkv)}


def test_per_head_offsets_are_counted_in_the_gradient_norm_on_tp_rank_0_only():
    ranks = run_ranks(_duplicate_flags, Layout(tp=2))
    for rank, flags in enumerate(ranks):
        assert flags["offset_sizes"].tolist() == [HEADS // 2] * 2  # this rank's heads only
        assert flags["offset_marked_sharded"].tolist() == [0.0, 0.0]
        assert flags["offset_counted"].tolist() == [float(rank == 0)] * 2
        assert flags["qkv_counted"].tolist() == [1.0, 1.0]  # control: a TP-sharded weight
