"""Transformer Engine's own modules on shardcheck's CPU extension, against plain torch.

Each CPU kernel of :mod:`shardcheck.megatron.cpu.te.extension` is checked directly and through
TE's unmodified module classes (``Linear``, ``LayerNorm``, ``RMSNorm``, ``LayerNormLinear``,
``LayerNormMLP``, ``DotProductAttention``), forward and backward, in fp32 and bf16, against
the same computation written in plain torch with autograd.
"""

import sys

import pytest
import torch
import torch.nn.functional as F

from shardcheck.megatron.cpu import patches
from shardcheck.megatron.cpu.te import (
    CACHED_TENSORS,
    QuantisationRefused,
    WaitOnce,
    forget_cached_tensors,
    installed,
    te_dir,
    unquantised,
)

if not (te_dir() / "transformer_engine").is_dir():
    pytest.skip(f"transformer-engine is not installed in {te_dir()}", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(scope="module")
def te():
    patches.apply_cpu_patches()
    try:
        with installed() as te_pytorch:
            yield te_pytorch
    finally:
        patches.remove_cpu_patches()


def _randn(*shape, seed=0, dtype=torch.float32, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(grad)


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


# ---- the extension's functions, called as TE calls them -----------------------------------------

@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_gemm_layouts_match_matmul(te, layout):
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    a, b = {"TN": ((8, 16), (3, 5, 16)), "NN": ((8, 16), (15, 8)), "NT": ((15, 16), (15, 8))}[layout]
    A, B = _randn(*a), _randn(*b, seed=1)
    expected = {"TN": lambda: B @ A.t(), "NN": lambda: B @ A, "NT": lambda: B.t() @ A}[layout]()
    out, *_ = general_gemm(A, B, out_dtype=torch.float32, layout=layout)
    _close(out, expected, torch.float32)


def test_gemm_bias_gelu_epilogues_and_accumulation(te):
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    w, x, bias = _randn(8, 16), _randn(6, 16, seed=1), _randn(8, seed=2)
    out, _, pre_gelu, _ = general_gemm(w, x, out_dtype=torch.float32, bias=bias, gelu=True)
    _close(pre_gelu, x @ w.t() + bias, torch.float32)
    _close(out, F.gelu(x @ w.t() + bias, approximate="tanh"), torch.float32)
    dy = _randn(6, 8, seed=3)
    wgrad, dbias, *_ = general_gemm(x, dy, out_dtype=torch.float32, layout="NT", bias=bias, grad=True)
    _close(wgrad, dy.t() @ x, torch.float32)
    _close(dbias, dy.sum(0), torch.float32)
    main_grad = torch.ones(8, 16)
    general_gemm(x, dy, out_dtype=torch.float32, layout="NT", out=main_grad, accumulate=True)
    _close(main_grad, 1 + dy.t() @ x, torch.float32)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_kernels_match_autograd(te, dtype, zero_centered):
    import transformer_engine_torch as tex

    x, gamma, beta = _randn(5, 16, dtype=dtype), _randn(16, seed=1, dtype=dtype), _randn(16, seed=2, dtype=dtype)
    dz = _randn(5, 16, seed=3, dtype=dtype)
    xs, gs, bs = (t.float().requires_grad_() for t in (x, gamma, beta))
    scale = gs + 1 if zero_centered else gs
    layer_norm = F.layer_norm(xs, (16,), scale, bs, eps=1e-5)
    y, mu, rsigma = tex.layernorm_fwd(x, gamma, beta, 1e-5, None, None, tex.DType.kFloat32, 0, zero_centered)
    _close(y, layer_norm, dtype)
    dx, dgamma, dbeta = tex.layernorm_bwd(dz, x, mu, rsigma, gamma, 0, zero_centered)
    for ours, ref in zip((dx, dgamma, dbeta), torch.autograd.grad(layer_norm, (xs, gs, bs), dz.float()),
                         strict=True):
        _close(ours, ref, dtype)
    rms = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-5) * scale
    y, _, rsigma = tex.rmsnorm_fwd(x, gamma, 1e-5, None, None, tex.DType.kFloat32, 0, zero_centered)
    _close(y, rms, dtype)
    dx, dgamma = tex.rmsnorm_bwd(dz, x, rsigma, gamma, 0, zero_centered)
    for ours, ref in zip((dx, dgamma), torch.autograd.grad(rms, (xs, gs), dz.float()), strict=True):
        _close(ours, ref, dtype)


ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x), "srelu": lambda x: F.relu(x) ** 2,
    "swiglu": lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
    "geglu": lambda x: F.gelu(x.chunk(2, -1)[0], approximate="tanh") * x.chunk(2, -1)[1],
    "reglu": lambda x: F.relu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
    "glu": lambda x: torch.sigmoid(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_and_its_backward(te, name, dtype):
    import transformer_engine_torch as tex

    x = _randn(4, 12, dtype=dtype)
    xs = x.float().requires_grad_()
    expected = ACTIVATIONS[name](xs)
    _close(getattr(tex, name)(x, None), expected, dtype)
    grad = _randn(*expected.shape, seed=5, dtype=dtype)
    (ref,) = torch.autograd.grad(expected, xs, grad.float())
    _close(getattr(tex, f"d{name}")(grad, x, None), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_variants_and_backward(te, dtype):
    import transformer_engine_torch as tex

    scores = _randn(2, 3, 5, 5, dtype=dtype)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    mask = _randn(2, 1, 5, 5, seed=1) > 0.5
    cases = [
        (tex.scaled_softmax_forward(scores, 0.5), None),
        (tex.scaled_masked_softmax_forward(scores, mask, 0.5), mask),
        (tex.scaled_upper_triang_masked_softmax_forward(scores, 0.5), causal),
        (tex.scaled_aligned_causal_masked_softmax_forward(scores, 0.5), causal),
    ]
    for probs, masked in cases:
        xs = scores.float().requires_grad_()
        logits = xs * 0.5 if masked is None else (xs * 0.5).masked_fill(masked, -10000.0)
        expected = torch.softmax(logits, -1)
        _close(probs, expected, dtype)
        grad = _randn(*probs.shape, seed=7, dtype=dtype)
        (ref,) = torch.autograd.grad(expected, xs, grad.float())
        _close(tex.scaled_softmax_backward(grad, probs, 0.5), ref, dtype)


@pytest.mark.parametrize("layout", ["sbhd_sbhd_sbhd", "sbhd_sb2hd"])  # K and V packed: same views
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_attention_returns_output_and_log_sum_exp_and_its_backward(te, dtype, layout):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions.fused_attn import fused_attn_bwd, fused_attn_fwd

    q, k, v = (_randn(6, 2, 4, 8, seed=s, dtype=dtype) for s in range(3))  # sbhd, 2 kv groups
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    out, aux, *_ = fused_attn_fwd(
        True, 6, 6, cu, cu, q, k, v, dtype, tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen,
        attn_scale=0.3, qkv_layout=layout, attn_mask_type="causal")
    qs, ks, vs = (t.float().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    reference = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.3, enable_gqa=True)
    _close(out, reference.permute(2, 0, 1, 3), dtype)
    scores = (qs @ ks.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(
        torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(aux[0].float(), torch.logsumexp(scores, -1, keepdim=True).detach(),
                               **TOL[dtype])
    d_out = _randn(*out.shape, seed=9, dtype=dtype)
    dq, dk, dv, *_ = fused_attn_bwd(
        6, 6, cu, cu, q, k, v, out, d_out, dtype, aux,
        tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen, attn_scale=0.3,
        qkv_layout=layout, attn_mask_type="causal")
    expected = torch.autograd.grad(reference, (qs, ks, vs), d_out.float().permute(1, 2, 0, 3))
    for ours, ref in zip((dq, dk, dv), expected, strict=True):
        _close(ours, ref.permute(2, 0, 1, 3), dtype)


def _per_sequence_reference(q, k, v, cu, starts, causal, scale):
    """Plain-torch attention of each packed sequence ``[s, h, d]`` on its own, fp32, with
    autograd: the outputs at their rows (zeros elsewhere), the log-sum-exp ``[t, h, 1]`` and
    the largest score per head."""
    out = torch.zeros(q.shape)
    lse = torch.full((*q.shape[:2], 1), float("-inf"))
    peak = torch.full(q.shape[1:2], float("-inf"))
    for start, length in zip(starts, (cu[1:] - cu[:-1]).tolist(), strict=True):
        rows = slice(start, start + length)
        qs, ks, vs = (t[rows].permute(1, 0, 2) for t in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale).permute(1, 0, 2)
        scores = qs @ ks.transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        lse[rows] = torch.logsumexp(scores, -1, keepdim=True).permute(1, 0, 2).detach()
        peak = torch.maximum(peak, scores.detach().amax((1, 2)))
    return out, lse, peak


@pytest.mark.parametrize("padded", [False, True])  # padded: a gap after each sequence
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_attention_on_packed_sequences_attends_within_each(te, dtype, mask, padded):
    """thd, uneven lengths 5, 3, 8: forward, log-sum-exp per token and backward against each
    sequence attended on its own; rows outside every sequence get zeros."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions.fused_attn import fused_attn_bwd, fused_attn_fwd

    cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    cu_padded = torch.tensor([0, 6, 10, 19], dtype=torch.int32) if padded else cu
    tokens = int(cu_padded[-1]) + 1 if padded else 16
    q, k, v = (_randn(tokens, 2, 8, seed=s, dtype=dtype) for s in range(3))
    backend = tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen
    common = dict(attn_scale=0.3, qkv_layout="thd_thd_thd", attn_mask_type=mask, o_format="thd",
                  cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded)
    out, aux, max_logit = fused_attn_fwd(True, 8, 8, cu, cu, q, k, v, dtype, backend,
                                         return_max_logit=True, **common)
    floats = [t.float().requires_grad_() for t in (q, k, v)]
    reference, lse, peak = _per_sequence_reference(*floats, cu, cu_padded[:-1].tolist(),
                                                   "causal" in mask, 0.3)
    _close(out, reference, dtype)
    _close(max_logit, peak, dtype)
    valid = lse.isfinite()
    assert torch.equal(aux[0].isfinite(), valid)
    torch.testing.assert_close(aux[0][valid].float(), lse[valid], **TOL[dtype])
    d_out = _randn(*out.shape, seed=9, dtype=dtype)
    grads = fused_attn_bwd(8, 8, cu, cu, q, k, v, out, d_out, dtype, aux, backend, do_format="thd",
                           **common)
    for ours, ref in zip(grads[:3], torch.autograd.grad(reference, floats, d_out.float()), strict=True):
        _close(ours, ref, dtype)


def test_a_packed_sequence_longer_than_max_seqlen_is_refused(te):
    """cuDNN sizes its problem by max_seqlen: a longer sequence fails here rather than attend
    over whatever the CPU kernel would make of it (so a wrong max_seqlen is a crash finding)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions.fused_attn import fused_attn_fwd

    cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    q, k, v = (_randn(16, 2, 8, seed=s, dtype=torch.bfloat16) for s in range(3))
    with pytest.raises(ValueError, match="a packed sequence of 8 tokens exceeds max_seqlen 7"):
        fused_attn_fwd(True, 7, 8, cu, cu, q, k, v, torch.bfloat16,
                       tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen, qkv_layout="thd_thd_thd",
                       o_format="thd", attn_mask_type="padding_causal")
    with pytest.raises(ValueError, match="exceeds max_seqlen 7"):
        tex.convert_thd_to_bshd(q, cu, 3, 7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_product_attention_module_on_packed_sequences(te, dtype):
    """TE's DotProductAttention on thd with a padding-causal mask: fp32 runs its unfused
    attention (thd converted to a padded batch and back), bf16 its fused attention."""
    attention = te.DotProductAttention(2, 8, attn_mask_type="padding_causal", qkv_format="thd",
                                       softmax_scale=0.3)
    cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    q, k, v = (_randn(16, 2, 8, seed=s, dtype=dtype, grad=True) for s in range(3))
    out = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=8)
    floats = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference, *_ = _per_sequence_reference(*floats, cu, cu[:-1].tolist(), True, 0.3)
    _close(out, reference.reshape(16, 16), dtype)
    grad = _randn(*out.shape, seed=99, dtype=dtype)
    for ours, ref in zip(torch.autograd.grad(out, (q, k, v), grad),
                         torch.autograd.grad(reference, floats, grad.float().reshape(16, 2, 8)), strict=True):
        _close(ours, ref, dtype)


# ---- TE's module classes, unmodified -------------------------------------------------------------

def _check_module(module, x, reference, dtype):
    """``module(x)`` and its input and parameter gradients against ``reference`` in fp32."""
    y = module(x)
    leaves = [x, *module.parameters()]
    floats = [t.detach().float().requires_grad_() for t in leaves]
    expected = reference(*floats)
    _close(y, expected, dtype)
    grad = _randn(*y.shape, seed=99, dtype=dtype)
    for ours, ref in zip(torch.autograd.grad(y, leaves, grad),
                         torch.autograd.grad(expected, floats, grad.float()), strict=True):
        _close(ours, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_module(te, dtype):
    _check_module(te.Linear(16, 8, params_dtype=dtype), _randn(3, 2, 16, dtype=dtype, grad=True),
                  F.linear, dtype)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_modules(te, kind, dtype, zero_centered):
    layer = getattr(te, kind)(16, eps=1e-5, params_dtype=dtype, zero_centered_gamma=zero_centered)
    with torch.no_grad():
        layer.weight.copy_(_randn(16, seed=4))

    def reference(x, weight, *bias):
        gamma = weight + 1 if zero_centered else weight
        if kind == "LayerNorm":
            return F.layer_norm(x, (16,), gamma, *bias, eps=1e-5)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma

    _check_module(layer, _randn(3, 2, 16, dtype=dtype, grad=True), reference, dtype)


def _reference_mlp(x, ln_w, ln_b, fc1_w, fc1_b, fc2_w, fc2_b, activation):
    h = F.linear(F.layer_norm(x, (x.shape[-1],), ln_w, ln_b, eps=1e-5), fc1_w, fc1_b)
    return F.linear(ACTIVATIONS[activation](h), fc2_w, fc2_b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_linear_and_layernorm_mlp_modules(te, activation, dtype):
    torch.manual_seed(0)
    ln_linear = te.LayerNormLinear(16, 8, eps=1e-5, params_dtype=dtype)
    mlp = te.LayerNormMLP(16, 24, eps=1e-5, activation=activation, params_dtype=dtype)
    with torch.no_grad():
        for p in (ln_linear.layer_norm_weight, mlp.layer_norm_weight):
            p.copy_(_randn(16, seed=4))
    x = _randn(3, 2, 16, dtype=dtype, grad=True)
    _check_module(ln_linear, x, lambda xs, lw, lb, w, b: F.linear(
        F.layer_norm(xs, (16,), lw, lb, eps=1e-5), w, b), dtype)
    _check_module(mlp, x, lambda xs, *p: _reference_mlp(xs, *p, activation), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dot_product_attention_module(te, dtype):
    """fp32 runs TE's unfused attention (its softmax kernels), bf16 its fused attention."""
    attention = te.DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type="causal",
                                       qkv_format="sbhd", softmax_scale=0.3)
    q = _randn(6, 2, 4, 8, dtype=dtype, grad=True)
    k, v = (_randn(6, 2, 2, 8, seed=s, dtype=dtype, grad=True) for s in (1, 2))
    out = attention(q, k, v)
    floats = [t.detach().float().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*floats, is_causal=True, scale=0.3, enable_gqa=True)
    expected = reference.permute(2, 0, 1, 3).reshape(6, 2, 32)
    _close(out, expected, dtype)
    grad = _randn(*out.shape, seed=99, dtype=dtype)
    for ours, ref in zip(torch.autograd.grad(out, (q, k, v), grad),
                         torch.autograd.grad(expected, floats, grad.float()), strict=True):
        _close(ours, ref.permute(2, 0, 1, 3), dtype)


def test_fp8_recipes_are_refused_in_one_line(te):
    from transformer_engine.common import recipe

    layer = te.Linear(16, 16)
    for fp8_recipe in (recipe.DelayedScaling(), recipe.MXFP8BlockScaling(), recipe.NVFP4BlockScaling()):
        with pytest.raises(QuantisationRefused, match=f"{type(fp8_recipe).__name__} recipe refused"):
            with te.autocast(enabled=True, recipe=fp8_recipe):
                layer(_randn(4, 16))


def test_context_parallel_ring_requests_are_waited_on_once(te):
    """TE's ring waits twice on each key/value exchange in its backward; a Gloo request's second
    ``wait()`` blocks until the process group's timeout. Its exchange hands out requests whose
    own ``wait()`` runs once (the ring itself runs at cp2 in tests/test_te_gpt.py)."""
    from transformer_engine.pytorch.attention.dot_product_attention import context_parallel

    class Request:
        waits = 0

        def wait(self):
            self.waits += 1

    request = Request()
    once = WaitOnce(request)
    assert once.wait() and once.wait()
    assert request.waits == 1
    exchange = context_parallel.flash_attn_p2p_communicate
    assert exchange.__wrapped__.__module__ == context_parallel.__name__


def test_te_tensor_caches_are_emptied_so_each_checked_region_builds_its_own(te):
    """TE keeps its causal masks (and a few other tensors) per process. A warm rank's scenario
    under another mesh than the one before it read the mask cached in the earlier checked region,
    a tensor of unknown type there, and so lost the type of every attention output after it.
    :func:`forget_cached_tensors`, run before each Megatron scenario, empties those caches."""
    import shardcheck as sc

    assert all(hasattr(sys.modules[module], name) for module, name in CACHED_TENSORS)
    attention = te.DotProductAttention(4, 8, attn_mask_type="causal", qkv_format="sbhd")

    def output_type(axis: str):
        with sc.typecheck(sc.Mesh(rank=0, **{axis: [0, 1]}), mode="collect") as checker:
            q, k, v = (sc.annotate(_randn(6, 2, 4, 8, seed=s), **{axis: sc.R}) for s in range(3))
            return checker.types(attention(q, k, v))

    forget_cached_tensors()
    assert output_type("dp") == (sc.R,)
    assert output_type("tp") is None  # the mask cached in the dp region
    forget_cached_tensors()
    assert output_type("tp") == (sc.R,)


def test_unquantised_recipes_run_te_in_the_models_precision_and_are_refused_outside(te):
    """The audit's FP8/FP4 stand-in (:func:`unquantised`): inside it TE's autocast takes every
    recipe, records it as TE does, and quantises nothing, so a layer's outputs and gradients are
    exactly those without autocast; outside it the recipe is refused in one line again."""
    from transformer_engine.common import recipe
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    layer = te.Linear(16, 16)
    x = _randn(4, 16, grad=True)
    expected = layer(x)
    expected_grads = torch.autograd.grad(expected.sum(), (x, layer.weight))
    for fp8_recipe in (recipe.DelayedScaling(), recipe.MXFP8BlockScaling(), recipe.NVFP4BlockScaling()):
        with unquantised(), te.autocast(enabled=True, recipe=fp8_recipe):
            assert FP8GlobalStateManager.get_fp8_recipe() is fp8_recipe
            assert not FP8GlobalStateManager.is_fp8_enabled()
            out = layer(x)
            grads = torch.autograd.grad(out.sum(), (x, layer.weight))
        assert torch.equal(out, expected)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
        with pytest.raises(QuantisationRefused):
            with te.autocast(enabled=True, recipe=fp8_recipe):
                layer(x)


def test_te_checkpoint_restores_the_cpu_generator_and_recomputes_the_same_gradients(te):
    """TE's checkpoint saves and restores its 'CUDA' RNG state: the CPU generator's here (a
    CPU-only torch has no CUDA generator), so a dropout inside it draws the same mask again
    when its forward is recomputed in the backward."""
    from transformer_engine.pytorch.distributed import _get_cuda_rng_state, checkpoint

    assert torch.equal(_get_cuda_rng_state(), torch.get_rng_state())
    layer = te.Linear(16, 16)

    def block(inp):
        return F.dropout(layer(inp), p=0.5)

    def gradients(run) -> list[torch.Tensor]:  # TE's checkpoint refuses autograd.grad
        x = _randn(4, 16, grad=True)
        layer.weight.grad = None
        torch.manual_seed(7)
        run(x).sum().backward()
        return [x.grad, layer.weight.grad]

    expected = gradients(block)
    recomputed = gradients(lambda x: checkpoint(block, x))
    assert all(torch.equal(a, b) for a, b in zip(recomputed, expected, strict=True))
