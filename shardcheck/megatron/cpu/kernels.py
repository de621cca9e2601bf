"""Plain-torch equivalents of the CUDA/Triton kernels Megatron's SSM layers call.

megatron-core's Gated DeltaNet and Mamba layers import their kernels from packages that only
build with CUDA (``fla``, ``causal_conv1d``, ``mamba_ssm``) and fall back to ``None`` when they
are missing. Each function here computes what one of those kernels computes, in its calling
convention, with ordinary differentiable torch ops, written as the definition (sequential
recurrences, explicit sums) rather than the fast chunked algorithm: the sizes we run are tiny,
and a definition is what a parity check should be measured against.

* :func:`causal_conv1d_fn` (``causal_conv1d``): depthwise causal convolution + optional SiLU.
* :func:`causal_conv1d` (``fla.modules.convolution``): the same convolution in FLA's
  convention ([batch, seq, dim] in, ``(out, final_state)`` back), which megatron-core 0.19
  calls.
* :func:`l2norm` (``fla.modules.l2norm``): ``x / sqrt(sum(x**2) + eps)`` on the last dim.
* :func:`chunk_gated_delta_rule` (``fla.ops.gated_delta_rule``): the gated delta rule.
* :func:`mamba_chunk_scan_combined` (``mamba_ssm``): the Mamba-2 SSD scan.
* :func:`mamba_split_conv1d_scan_combined` (``mamba_ssm``): split of the fused projection,
  convolution and scan in one call (the memory-efficient training path).
* :class:`RMSNormGated` (``mamba_ssm``'s gated RMSNorm): grouped RMSNorm with a SiLU gate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, **unsupported) -> torch.Tensor:
    """Depthwise causal conv: ``out[b, d, t] = sum_j weight[d, j] * x[b, d, t - w + 1 + j]``.

    ``x`` is [batch, dim, seq], ``weight`` [dim, width]; then ``+ bias[d]`` and SiLU if
    ``activation`` is ``"silu"``/``"swish"``.
    """
    _refuse(unsupported)
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"causal_conv1d activation {activation!r}")
    width, seq = weight.shape[-1], x.shape[-1]
    padded = F.pad(x, (width - 1, 0))
    out = sum(weight[:, j, None] * padded[..., j:j + seq] for j in range(width))
    if bias is not None:
        out = out + bias[:, None]
    return F.silu(out) if activation is not None else out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, **unsupported) -> tuple[torch.Tensor, None]:
    """:func:`causal_conv1d_fn` in FLA's convention: ``x`` is [batch, seq, dim]; returns the
    output in the same layout and no final state."""
    _refuse(unsupported)
    return causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation).transpose(1, 2), None


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, **_options) -> torch.Tensor:
    """``x / sqrt(sum(x**2, dim) + eps)``, as FLA's ``l2norm`` (computed in float32)."""
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(dim, keepdim=True) + eps)).to(x.dtype)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: float | None = None,
                           initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, **unsupported,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule, step by step; FLA's layout: q, k [B, T, H, K], v [B, T, H, V].

    With state ``S`` [B, H, K, V] (zeros unless ``initial_state``), at each step t:
    ``S = exp(g_t) S``; ``S += k_t (beta_t (v_t - S^T k_t))^T``; ``o_t = S^T (scale q_t)``,
    where ``g`` [B, T, H] is the log decay, ``beta`` [B, T, H] the write strength and
    ``scale`` defaults to ``K ** -0.5``. Returns (o [B, T, H, V], final state or None).
    """
    _refuse(unsupported)
    dtype = q.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    batch, steps, heads, key_dim = k.shape
    state = (torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=torch.float32)
             if initial_state is None else initial_state.float())
    outputs = []
    for t in range(steps):
        state = state * g[:, t].exp()[..., None, None]
        recalled = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        delta = beta[:, t, :, None] * (v[:, t] - recalled)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state))
    out = torch.stack(outputs, dim=1).to(dtype)
    return out, (state if output_final_state else None)


def mamba_chunk_scan_combined(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                              C: torch.Tensor, chunk_size: int | None = None, D: torch.Tensor | None = None,
                              z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                              initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
                              dt_limit: tuple[float, float] = (0.0, math.inf),
                              return_final_states: bool = False, **unsupported):
    """The Mamba-2 selective state-space scan, step by step (``chunk_size`` is irrelevant).

    x [b, l, h, p], dt [b, l, h], A [h], B and C [b, l, g, n] (head i reads group
    ``i // (h / g)``), D [h] or [h, p], z [b, l, h, p]. With ``dt = dt + dt_bias``, softplus
    if asked, clamped to ``dt_limit``, and state ``s`` [b, h, p, n]:
    ``s = exp(dt_t A) s + dt_t x_t B_t^T``; ``y_t = s C_t + D x_t``; ``y *= silu(z)`` if z.
    Returns y (and the final state if ``return_final_states``).
    """
    _refuse(unsupported)
    dtype = x.dtype
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    dt = F.softplus(dt) if dt_softplus else dt
    if dt_limit != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    heads_per_group = x.shape[2] // B.shape[2]
    B, C = (t.float().repeat_interleave(heads_per_group, dim=2) for t in (B, C))
    xf = x.float()
    state = (torch.zeros(*x.shape[:1], *x.shape[2:], B.shape[-1], dtype=torch.float32)
             if initial_states is None else initial_states.float())
    outputs = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A.float())[..., None, None]
        write = torch.einsum("bhp,bhn->bhpn", xf[:, t] * dt[:, t, :, None], B[:, t])
        state = decay * state + write
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(outputs, dim=1)
    if D is not None:
        y = y + xf * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype)
    return (y, state) if return_final_states else y


def mamba_split_conv1d_scan_combined(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor,
                                     conv1d_bias: torch.Tensor | None, dt_bias: torch.Tensor,
                                     A: torch.Tensor, D: torch.Tensor, chunk_size: int,
                                     activation: str = "silu", headdim: int | None = None,
                                     ngroups: int = 1, norm_before_gate: bool = True,
                                     dt_limit: tuple[float, float] = (0.0, math.inf),
                                     **unsupported) -> torch.Tensor:
    """Mamba-2's fused training step without its optional norm and output projection.

    ``zxbcdt`` [b, l, 2*d_inner + 2*ngroups*d_state + nheads] is split into z, xBC, dt; xBC
    goes through :func:`causal_conv1d_fn`, is split into x, B, C, and
    :func:`mamba_chunk_scan_combined` runs with ``dt_softplus`` and the gate ``z``.
    Returns y [b, l, d_inner]. (``norm_before_gate`` only matters with a norm weight.)
    """
    _refuse(unsupported)
    nheads = dt_bias.shape[0]
    headdim = D.shape[-1] if D.dim() == 2 else headdim
    d_inner = nheads * headdim
    d_state = (zxbcdt.shape[-1] - 2 * d_inner - nheads) // (2 * ngroups)
    z, xbc, dt = torch.split(zxbcdt, [d_inner, d_inner + 2 * ngroups * d_state, nheads], dim=-1)
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias,
                           activation=activation).transpose(1, 2)
    x, B, C = torch.split(xbc, [d_inner, ngroups * d_state, ngroups * d_state], dim=-1)
    batch, length = x.shape[:2]
    y = mamba_chunk_scan_combined(
        x.reshape(batch, length, nheads, headdim), dt, A,
        B.reshape(batch, length, ngroups, d_state), C.reshape(batch, length, ngroups, d_state),
        chunk_size, D=D, z=z.reshape(batch, length, nheads, headdim), dt_bias=dt_bias,
        dt_softplus=True, dt_limit=dt_limit)
    return y.reshape(batch, length, d_inner)


class RMSNormGated(torch.nn.Module):
    """mamba_ssm's gated RMSNorm: ``rmsnorm(x * silu(z))`` (or ``rmsnorm(x) * silu(z)``).

    The RMS is taken over groups of ``group_size`` consecutive channels (all channels when
    None), then scaled by ``weight`` (and ``+ bias`` when it has one).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """Gate, normalise per group and scale ``x`` [..., hidden]."""
        dtype, xf = x.dtype, x.float()
        if z is not None and not self.norm_before_gate:
            xf = xf * F.silu(z.float())
        size = self.group_size or xf.shape[-1]
        grouped = xf.unflatten(-1, (-1, size))
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        out = normed.flatten(-2) * self.weight.float()
        if self.bias is not None:
            out = out + self.bias.float()
        if z is not None and self.norm_before_gate:
            out = out * F.silu(z.float())
        return out.to(dtype)


def _refuse(options: dict) -> None:
    """Options the plain kernels do not implement (variable-length batches, states) must be unset."""
    used = sorted(name for name, value in options.items()
                  if value is not None and value is not False)
    if used:
        raise NotImplementedError(f"plain-torch kernel does not support: {', '.join(used)}")
