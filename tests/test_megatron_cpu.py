"""Each CPU patch lets megatron-core run without changing a number."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.tensor_parallel import random as mrandom  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from shardcheck.megatron.cpu import patches as cpu  # noqa: E402


@pytest.fixture
def patched():
    cpu.apply_cpu_patches()
    try:
        yield
    finally:
        cpu.remove_cpu_patches()


def _config(**kw):
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                             use_cpu_initialization=True, **kw)


def test_rng_tracker_draws_what_a_plainly_seeded_cpu_generator_draws(patched):
    mrandom.model_parallel_cuda_manual_seed(7, tp_rank=1, ep_rank=0, etp_rank=0)
    outside = torch.get_rng_state()
    with mrandom.get_cuda_rng_tracker().fork():
        tracked = torch.randn(5)
    assert torch.equal(torch.get_rng_state(), outside)  # the fork restored the outer generator
    expected = torch.randn(5, generator=torch.Generator().manual_seed(7 + 2718 + 1))
    assert torch.equal(tracked, expected)
    with mrandom.get_cuda_rng_tracker().fork():  # the tracked stream continues, not restarts
        assert not torch.equal(torch.randn(5), expected)


def test_current_device_is_the_cpu(patched):
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"


def test_torch_norm_under_sequence_parallel_is_plain_layernorm_marked_sp(patched):
    config = _config(tensor_model_parallel_size=2, sequence_parallel=True)
    norm = WrappedTorchNorm(config, 8)
    plain = torch.nn.LayerNorm(8, eps=1e-5)
    with torch.no_grad():
        for ours, theirs in zip(norm.parameters(), plain.parameters(), strict=True):
            ours.copy_(torch.randn_like(ours))
            theirs.copy_(ours)
    x = torch.randn(4, 8)
    assert torch.equal(norm(x), plain(x))
    assert all(p.sequence_parallel for p in norm.parameters())
    assert config.sequence_parallel  # the caller's config is untouched


def test_torch_norm_without_sequence_parallel_is_unchanged(patched):
    norm = WrappedTorchNorm(_config(normalization="RMSNorm"), 8, eps=1e-3)
    assert type(norm) is torch.nn.RMSNorm and norm.eps == 1e-3  # the caller's config and arguments
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = torch.randn(4, 8)
    assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-3))
    assert not any(hasattr(p, "sequence_parallel") for p in norm.parameters())  # not marked


def test_device_mode_sends_cuda_requests_to_the_cpu_with_equal_values(patched):
    x = torch.randn(3)
    assert torch.equal(torch.zeros(2, device="cuda"), torch.zeros(2))
    assert torch.equal(torch.arange(4, device=torch.device("cuda", 0)), torch.arange(4))
    assert x.cuda() is x and x.pin_memory() is x and not x.is_pinned()
    assert torch.equal(x.to("cuda"), x)
    assert torch.empty(2, pin_memory=True).device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.type(torch.float64).dtype == torch.float64


def test_synchronize_streams_and_events_do_nothing(patched):
    torch.cuda.synchronize()
    torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.ones(2) * 3
    assert torch.equal(x, torch.full((2,), 3.0))
    event = side.record_event()
    event.synchronize()
    assert event.query() and torch.cuda.Event().query()


def test_host_copy_gives_numpy_split_sizes_with_the_same_values(patched):
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    splits = torch.tensor([3, 5])
    assert token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu
    host = moe_utils.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert host.tolist() == [3, 5] and type(host).__module__ == "numpy"
    assert moe_utils.maybe_move_tensor_to_cpu(splits) is splits


def test_patches_apply_once_and_remove_restores_every_original():
    before = (torch.cuda.current_device, torch.cuda.synchronize, mrandom._get_cuda_rng_state,
              WrappedTorchNorm.__new__)
    cpu.apply_cpu_patches()
    cpu.apply_cpu_patches()
    assert cpu.cpu_patches_active()
    cpu.remove_cpu_patches()
    assert not cpu.cpu_patches_active()
    after = (torch.cuda.current_device, torch.cuda.synchronize, mrandom._get_cuda_rng_state,
             WrappedTorchNorm.__new__)
    assert after == before
    assert torch.ones(1).type() == "torch.FloatTensor"


def _uneven_exchange(rows_of_rank: list[int]) -> dict:
    import torch.distributed as dist

    cpu.apply_cpu_patches()
    try:
        rank = dist.get_rank()
        mine = torch.full((rows_of_rank[rank], 2), float(rank + 1))
        gathered = [torch.empty(rows, 2) for rows in rows_of_rank]
        dist.all_gather(gathered, mine)
        pieces = [torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) * (rank + 1)
                  for rows in rows_of_rank]
        reduced = torch.empty(rows_of_rank[rank], 2)
        dist.reduce_scatter(reduced, pieces)
        return {"gathered": torch.cat(gathered), "reduced": reduced}
    finally:
        cpu.remove_cpu_patches()


@pytest.mark.parametrize("rows_of_rank", [[3, 1], [2, 2]])
def test_uneven_collectives_give_what_nccl_gives(rows_of_rank):
    from shardcheck.parity.launch import spawn_ranks

    results = spawn_ranks(_uneven_exchange, 2, rows_of_rank)
    expected = torch.cat([torch.full((rows, 2), float(r + 1)) for r, rows in enumerate(rows_of_rank)])
    for rank, result in enumerate(results):
        assert torch.equal(result["gathered"], expected)
        own = torch.arange(rows_of_rank[rank] * 2, dtype=torch.float32).view(-1, 2)
        assert torch.equal(result["reduced"], own * 3)  # summed over ranks 1 and 2


def test_llava_accepts_sequence_parallel_with_megatron_torch_attention(patched):
    from megatron.core.models.multimodal import llava_model
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    assert llava_model.TEDotProductAttention is DotProductAttention and llava_model.HAVE_TE


def test_clip_vit_default_norms_are_megatron_layernorm_with_equal_values(patched):
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel

    passed = {}

    def init(_self, *args, **kwargs):
        passed.update(kwargs)

    cpu._with_default_norms(init, WrappedTorchNorm)(None, "config", "spec")
    assert passed == {"ln_pre_impl": WrappedTorchNorm, "ln_post_impl": WrappedTorchNorm}
    passed.clear()
    cpu._with_default_norms(init, WrappedTorchNorm)(None, "config", "spec", ln_post_impl=None)
    assert passed["ln_post_impl"] is None  # a norm passed explicitly is kept
    assert CLIPViTModel.__init__.__name__ == "init"  # the patch is in place
    config = _config()
    norm, plain = WrappedTorchNorm(config, 8), torch.nn.LayerNorm(8, eps=config.layernorm_epsilon)
    x = torch.randn(3, 8)
    assert torch.equal(norm(x), plain(x))


def test_multimodal_patches_are_removed_with_the_others():
    from megatron.core.models.multimodal import llava_model
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel

    def state():  # 0.16 leaves TEDotProductAttention undefined without TE, 0.19 sets it None
        return (llava_model.HAVE_TE, getattr(llava_model, "TEDotProductAttention", "unset"),
                CLIPViTModel.__init__)

    before = state()
    cpu.apply_cpu_patches()
    assert llava_model.HAVE_TE and llava_model.TEDotProductAttention is not before[1]
    cpu.remove_cpu_patches()
    assert state() == before and before[0] is False
def test_ssm_kernels_fill_the_failed_imports_and_are_removed_after():
    import sys

    from megatron.core.ssm import mamba_mixer
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from shardcheck.megatron.cpu import kernels

    home = sys.modules[GatedDeltaNet.__module__]  # where its forward reads its kernels
    cpu.apply_cpu_patches()
    try:
        assert home.chunk_gated_delta_rule is kernels.chunk_gated_delta_rule
        assert cpu.patch_status()["gdn_kernels"] == cpu.APPLIED
        assert mamba_mixer.mamba_split_conv1d_scan_combined is kernels.mamba_split_conv1d_scan_combined
        norm = mamba_mixer.ExtendedRMSNorm(8, group_size=4, norm_before_gate=False)
        assert isinstance(norm, kernels.RMSNormGated)
        assert "sharded_state_dict" in type(norm).__dict__  # Megatron's own method, kept
    finally:
        cpu.remove_cpu_patches()
    assert home.chunk_gated_delta_rule is None and not mamba_mixer.HAVE_MAMBA_SSM


def test_fla_causal_conv1d_is_the_plain_convolution_in_fla_layout():
    from shardcheck.megatron.cpu import kernels

    x, weight, bias = (torch.randn(*shape, dtype=torch.float64) for shape in ((2, 5, 3), (3, 4), (3,)))
    out, state = kernels.causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=None)
    # torch's depthwise conv, left-padded by width - 1, on [batch, dim, seq]: FLA's [batch, seq, dim]
    conv = torch.nn.functional.conv1d(x.transpose(1, 2), weight[:, None, :], bias, padding=3, groups=3)
    expected = torch.nn.functional.silu(conv[..., :5]).transpose(1, 2)
    assert state is None and out.shape == x.shape
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(NotImplementedError):
        kernels.causal_conv1d(x, weight, initial_state=torch.zeros(2, 3, 4))


def test_a_patch_whose_target_is_gone_is_listed_as_not_needed(monkeypatch):
    def gone() -> None:
        cpu._module("megatron.core.no_such_module_in_any_release")

    monkeypatch.setattr(cpu, "PATCHES", (*cpu.PATCHES, ("gone", gone)))
    cpu.apply_cpu_patches()
    try:
        status = cpu.patch_status()
    finally:
        cpu.remove_cpu_patches()
    assert status["gone"].startswith(cpu.NOT_NEEDED)
    assert "no_such_module_in_any_release" in status["gone"]
    assert status["rng"] == cpu.APPLIED


def test_gdn_gated_norm_runs_its_own_source_uncompiled(patched):
    from types import SimpleNamespace

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    assert "_apply_gated_norm" in dir(GatedDeltaNet)
    norm = torch.nn.RMSNorm(4, eps=1e-6)
    owner = SimpleNamespace(out_norm=norm, act_fn=torch.nn.functional.silu)
    x, gate = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    out = GatedDeltaNet._apply_gated_norm(owner, x, gate)
    assert not hasattr(GatedDeltaNet._apply_gated_norm, "_torchdynamo_orig_callable")
    expected = norm(x.reshape(-1, 4)) * torch.nn.functional.silu(gate.reshape(-1, 4))
    assert torch.equal(out, expected)


def test_compiled_functions_run_as_the_functions_they_wrap(patched):
    """Megatron's jit_fuser (torch.compile) would compile C++ for seconds at each first call:
    loaded compiled functions run as their own source, later ones are never compiled, with the
    same numbers as the formula they hold."""
    from megatron.core import jit
    from megatron.core.transformer import torch_norm

    norm = torch_norm.L2Norm(4, eps=1e-6)
    assert "_torchdynamo_orig_callable" not in vars(torch_norm.L2Norm._norm)
    assert torch_norm.L2Norm._norm.__code__.co_filename == torch_norm.__file__
    x = torch.randn(3, 4)
    assert torch.equal(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def later(t):
        return t + 1

    assert jit.jit_fuser(later) is later


def test_removing_the_patches_restores_the_compiled_functions():
    from megatron.core import jit
    from megatron.core.transformer import torch_norm

    compiled, fuser = torch_norm.L2Norm._norm, jit.jit_fuser
    cpu.apply_cpu_patches()
    cpu.remove_cpu_patches()
    assert (torch_norm.L2Norm._norm, jit.jit_fuser) == (compiled, fuser)
