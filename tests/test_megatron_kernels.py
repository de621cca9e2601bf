"""The plain-torch SSM kernels against independent definitions and known properties."""

import pytest
import torch
import torch.nn.functional as F

from shardcheck.megatron.cpu import kernels


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype)


# ---- causal conv1d ----------------------------------------------------------------------------

@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv1d_equals_padded_depthwise_conv1d(activation):
    x, weight, bias = _randn(2, 6, 9), _randn(6, 4, seed=1), _randn(6, seed=2)
    ours = kernels.causal_conv1d_fn(x, weight, bias, activation=activation)
    torch_conv = F.conv1d(x, weight[:, None, :], bias, padding=3, groups=6)[..., :9]
    expected = F.silu(torch_conv) if activation else torch_conv
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


def test_causal_conv1d_output_never_depends_on_later_inputs():
    x, weight = _randn(1, 3, 8), _randn(3, 4, seed=1)
    changed = x.clone()
    changed[..., 5:] += 1.0
    before, after = (kernels.causal_conv1d_fn(t, weight) for t in (x, changed))
    assert torch.equal(before[..., :5], after[..., :5])
    assert not torch.allclose(before[..., 5:], after[..., 5:])


def test_causal_conv1d_refuses_what_it_does_not_implement():
    x, weight = _randn(1, 3, 8), _randn(3, 4, seed=1)
    with pytest.raises(NotImplementedError, match="seq_idx"):
        kernels.causal_conv1d_fn(x, weight, seq_idx=torch.zeros(1, 8))
    with pytest.raises(NotImplementedError, match="relu"):
        kernels.causal_conv1d_fn(x, weight, activation="relu")


# ---- l2norm -----------------------------------------------------------------------------------

def test_l2norm_gives_unit_vectors_along_the_last_dim():
    x = _randn(3, 5, 7) * 10
    y = kernels.l2norm(x, eps=0.0)
    torch.testing.assert_close(y.norm(dim=-1), torch.ones(3, 5, dtype=torch.float64))
    torch.testing.assert_close(y, x / x.norm(dim=-1, keepdim=True))


def test_l2norm_eps_keeps_a_zero_vector_finite():
    assert torch.equal(kernels.l2norm(torch.zeros(2, 4)), torch.zeros(2, 4))


# ---- gated delta rule -------------------------------------------------------------------------

def _gdn_inputs(batch=2, steps=11, heads=3, key_dim=4, value_dim=5, seed=0):
    q = kernels.l2norm(_randn(batch, steps, heads, key_dim, seed=seed))
    k = kernels.l2norm(_randn(batch, steps, heads, key_dim, seed=seed + 1))
    v = _randn(batch, steps, heads, value_dim, seed=seed + 2)
    g = -F.softplus(_randn(batch, steps, heads, seed=seed + 3))
    beta = torch.sigmoid(_randn(batch, steps, heads, seed=seed + 4))
    return q, k, v, g, beta


def test_gated_delta_rule_equals_megatrons_own_chunked_torch_form():
    """Megatron ships a chunked (WY-form) torch implementation: a different algorithm."""
    gdn = pytest.importorskip("megatron.core.ssm.gated_delta_net")
    inputs = [t.requires_grad_(True) for t in _gdn_inputs()]
    ours, _ = kernels.chunk_gated_delta_rule(*inputs)
    theirs, _ = gdn.torch_chunk_gated_delta_rule(*inputs, chunk_size=4)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    weights = _randn(*ours.shape, seed=9)
    ours_grads = torch.autograd.grad((ours * weights).sum(), inputs)
    theirs_grads = torch.autograd.grad((theirs * weights).sum(), inputs)
    for mine, reference in zip(ours_grads, theirs_grads, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)


def test_gated_delta_rule_one_step_writes_beta_v_and_reads_it_back():
    q, k, v, g, beta = _gdn_inputs(steps=1)
    out, state = kernels.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    # from a zero state: S = k (beta v)^T, o = S^T q / sqrt(K)
    expected_state = torch.einsum("bhk,bhv->bhkv", k[:, 0], beta[:, 0, :, None] * v[:, 0])
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-6, atol=1e-6)
    expected = (q[:, 0] * k[:, 0]).sum(-1, keepdim=True) / 2 * beta[:, 0, :, None] * v[:, 0]
    torch.testing.assert_close(out[:, 0], expected)


def test_gated_delta_rule_with_full_writes_and_no_decay_recalls_the_latest_value():
    """beta = 1, g = 0: writing v under the unit key k makes S^T k == v exactly."""
    q, k, v, g, beta = _gdn_inputs(steps=4)
    _, state = kernels.chunk_gated_delta_rule(q, k, v, torch.zeros_like(g), torch.ones_like(beta),
                                              output_final_state=True)
    recalled = torch.einsum("bhk,bhkv->bhv", k[:, -1].float(), state)
    torch.testing.assert_close(recalled.double(), v[:, -1], rtol=1e-5, atol=1e-5)


def test_gated_delta_rule_is_causal_and_decays_with_g():
    q, k, v, g, beta = _gdn_inputs()
    out, _ = kernels.chunk_gated_delta_rule(q, k, v, g, beta)
    later = v.clone()
    later[:, 6:] += 1.0
    changed, _ = kernels.chunk_gated_delta_rule(q, k, later, g, beta)
    assert torch.equal(out[:, :6], changed[:, :6])
    forgetful, _ = kernels.chunk_gated_delta_rule(q, k, v, g - 50.0, beta)
    fresh, _ = kernels.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None)
    # with total decay, each step only sees its own write: o_t = (q_t.k_t) beta_t v_t / sqrt(K)
    own = (q * k).sum(-1, keepdim=True) / 2 * beta[..., None] * v
    torch.testing.assert_close(forgetful.double(), own, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(fresh.double(), own, atol=1e-3)


# ---- Mamba-2 scan -----------------------------------------------------------------------------

def _ssd_quadratic(x, dt, A, B, C, D):
    """The SSD 'attention' form: y_t = sum_{s<=t} (C_t . B_s) exp(sum_{s<r<=t} dt_r A) dt_s x_s."""
    steps, heads_per_group = x.shape[1], x.shape[2] // B.shape[2]
    B, C = (t.repeat_interleave(heads_per_group, dim=2) for t in (B, C))
    log_decay = (dt * A).cumsum(1)  # [b, l, h]
    segment = log_decay[:, :, None, :] - log_decay[:, None, :, :]  # [b, t, s, h]
    causal = torch.tril(torch.ones(steps, steps, dtype=torch.bool))[None, :, :, None]
    weights = torch.einsum("bthn,bshn->btsh", C, B) * segment.masked_fill(~causal, -torch.inf).exp()
    return torch.einsum("btsh,bsh,bshp->bthp", weights, dt, x) + x * D[:, None]


def _mamba_inputs(seed=0):
    x = _randn(2, 9, 4, 3, seed=seed)
    dt = F.softplus(_randn(2, 9, 4, seed=seed + 1))
    A = -torch.rand(4, generator=_gen(seed + 2), dtype=torch.float64) - 0.5
    B, C = _randn(2, 9, 2, 5, seed=seed + 3), _randn(2, 9, 2, 5, seed=seed + 4)
    D = _randn(4, seed=seed + 5)
    return x, dt, A, B, C, D


def test_mamba_scan_equals_the_quadratic_ssd_form():
    x, dt, A, B, C, D = _mamba_inputs()
    ours = kernels.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=4, D=D)
    torch.testing.assert_close(ours, _ssd_quadratic(x, dt, A, B, C, D), rtol=1e-5, atol=1e-6)


def test_mamba_scan_applies_dt_bias_softplus_limit_and_gate():
    x, dt, A, B, C, D = _mamba_inputs()
    raw, bias, z = _randn(2, 9, 4, seed=7), _randn(4, seed=8), _randn(*x.shape, seed=9)
    ours = kernels.mamba_chunk_scan_combined(x, raw, A, B, C, D=D, z=z, dt_bias=bias,
                                             dt_softplus=True, dt_limit=(0.1, 2.0))
    step = F.softplus(raw + bias).clamp(0.1, 2.0)
    expected = _ssd_quadratic(x, step, A, B, C, D) * F.silu(z)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_mamba_scan_returns_the_state_that_continues_the_sequence():
    x, dt, A, B, C, D = _mamba_inputs()
    whole = kernels.mamba_chunk_scan_combined(x, dt, A, B, C, D=D)
    head, state = kernels.mamba_chunk_scan_combined(x[:, :5], dt[:, :5], A, B[:, :5], C[:, :5],
                                                    D=D, return_final_states=True)
    tail = kernels.mamba_chunk_scan_combined(x[:, 5:], dt[:, 5:], A, B[:, 5:], C[:, 5:], D=D,
                                             initial_states=state)
    torch.testing.assert_close(torch.cat([head, tail], 1), whole)


# ---- gated RMSNorm ----------------------------------------------------------------------------

@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rmsnorm_normalises_each_group_and_gates(norm_before_gate):
    norm = kernels.RMSNormGated(8, eps=1e-5, group_size=4, norm_before_gate=norm_before_gate)
    with torch.no_grad():
        norm.weight.copy_(_randn(8, seed=3))
    x, z = _randn(3, 8), _randn(3, 8, seed=1)
    gated = x * F.silu(z) if not norm_before_gate else x
    groups = [F.rms_norm(part, (4,), eps=1e-5) for part in gated.split(4, dim=-1)]
    expected = torch.cat(groups, -1) * norm.weight.double()
    expected = expected * F.silu(z) if norm_before_gate else expected
    torch.testing.assert_close(norm(x.float(), z.float()).double(), expected, rtol=1e-5, atol=1e-6)


def test_gated_rmsnorm_without_groups_or_gate_is_plain_rmsnorm():
    norm = kernels.RMSNormGated(6)
    x = _randn(4, 6).float()
    torch.testing.assert_close(norm(x), F.rms_norm(x, (6,), eps=1e-5))
