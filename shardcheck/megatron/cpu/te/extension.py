"""A CPU ``transformer_engine_torch``: the extension functions TE's non-quantised path calls.

Transformer Engine's PyTorch modules are Python; their arithmetic goes through the compiled
``transformer_engine_torch`` extension (cuBLAS, cuDNN, its own CUDA kernels). This module
provides the same names with the same calling conventions in plain torch, for fp32, bf16 and
fp16 tensors: GEMM (with bias, GeLU epilogue and accumulation), LayerNorm and RMSNorm forward
and backward (zero-centred gamma included), the activations and their backward passes, the
softmax variants of the unfused attention, the fused attention forward and backward (returning
the log-sum-exp), and the device queries TE makes. Enumerations mirror the extension's.

Every other name of the extension resolves to a function that refuses in one line when it is
called (quantisation, userbuffers, grouped GEMM, MoE permutation kernels, ...): those are the
FP8/FP4 and GPU-only paths, which this module does not emulate.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


class DType(enum.IntEnum):
    """``transformer_engine::DType``."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


def _enum(name: str, members: str) -> type[enum.IntEnum]:
    return enum.IntEnum(name, [(member, value) for value, member in enumerate(members.split())])


NVTE_Bias_Type = _enum("NVTE_Bias_Type", "NVTE_NO_BIAS NVTE_PRE_SCALE_BIAS NVTE_POST_SCALE_BIAS NVTE_ALIBI")
NVTE_Mask_Type = _enum(
    "NVTE_Mask_Type",
    "NVTE_NO_MASK NVTE_PADDING_MASK NVTE_CAUSAL_MASK NVTE_PADDING_CAUSAL_MASK "
    "NVTE_CAUSAL_BOTTOM_RIGHT_MASK NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK",
)
NVTE_Softmax_Type = _enum(
    "NVTE_Softmax_Type", "NVTE_VANILLA_SOFTMAX NVTE_OFF_BY_ONE_SOFTMAX NVTE_LEARNABLE_SOFTMAX"
)
NVTE_QKV_Format = _enum(
    "NVTE_QKV_Format",
    "NVTE_BSHD NVTE_SBHD NVTE_THD NVTE_SBHD_2BSHD NVTE_BSHD_2SBHD NVTE_THD_2BSHD NVTE_THD_2SBHD "
    "NVTE_BHSD NVTE_QKV_Format_NOT_SET",
)
NVTE_QKV_Layout = _enum(
    "NVTE_QKV_Layout",
    "NVTE_SB3HD NVTE_SBH3D NVTE_SBHD_SB2HD NVTE_SBHD_SBH2D NVTE_SBHD_SBHD_SBHD NVTE_BS3HD "
    "NVTE_BSH3D NVTE_BSHD_BS2HD NVTE_BSHD_BSH2D NVTE_BSHD_BSHD_BSHD NVTE_T3HD NVTE_TH3D "
    "NVTE_THD_T2HD NVTE_THD_TH2D NVTE_THD_THD_THD NVTE_SBHD_BSHD_BSHD NVTE_BSHD_SBHD_SBHD "
    "NVTE_THD_BSHD_BSHD NVTE_THD_SBHD_SBHD NVTE_Paged_KV_BSHD_BSHD_BSHD "
    "NVTE_Paged_KV_BSHD_SBHD_SBHD NVTE_Paged_KV_SBHD_BSHD_BSHD NVTE_Paged_KV_SBHD_SBHD_SBHD "
    "NVTE_Paged_KV_THD_BSHD_BSHD NVTE_Paged_KV_THD_SBHD_SBHD NVTE_BHSD_BHSD_BHSD "
    "NVTE_QKV_Layout_NOT_SET",
)
NVTE_Fused_Attn_Backend = _enum(
    "NVTE_Fused_Attn_Backend", "NVTE_F16_arbitrary_seqlen NVTE_FP8 NVTE_No_Backend"
)
NVTEScalingMode = _enum(
    "NVTEScalingMode",
    "NVTE_DELAYED_TENSOR_SCALING NVTE_MXFP8_1D_SCALING NVTE_BLOCK_SCALING_1D "
    "NVTE_BLOCK_SCALING_2D NVTE_NVFP4_1D_SCALING NVTE_INVALID_SCALING",
)
Float8BlockScaleTensorFormat = _enum("Float8BlockScaleTensorFormat", "GEMM_READY COMPACT INVALID")
CommOverlapType = _enum("CommOverlapType", "RS AG")
CommOverlapAlgo = _enum(
    "CommOverlapAlgo",
    "BULK_OVERLAP_AG BULK_OVERLAP_RS SPLIT_PIPELINED_AG_P2P SPLIT_PIPELINED_RS "
    "SPLIT_PIPELINED_RS_P2P ATOMIC_GEMM_RS ATOMIC_GEMM_AG_P2P ATOMIC_GEMM_RS_P2P "
    "EXTERNAL_BULK_OVERLAP_AG",
)
FP8FwdTensors = _enum(
    "FP8FwdTensors",
    "GEMM1_INPUT GEMM1_WEIGHT GEMM1_OUTPUT GEMM2_INPUT GEMM2_WEIGHT GEMM2_OUTPUT GEMM3_INPUT "
    "GEMM3_WEIGHT GEMM3_OUTPUT",
)
FP8BwdTensors = _enum(
    "FP8BwdTensors", "GRAD_OUTPUT1 GRAD_INPUT1 GRAD_OUTPUT2 GRAD_INPUT2 GRAD_OUTPUT3 GRAD_INPUT3"
)
NVTERoutingMapFormat = _enum("NVTERoutingMapFormat", "BYTEMAP BITMAP_U8")
NVTEQBHistogramMode = _enum("NVTEQBHistogramMode", "TWO_KERNEL FUSED_ATOMIC")

_TORCH_DTYPE = {
    DType.kFloat32: torch.float32,
    DType.kFloat16: torch.float16,
    DType.kBFloat16: torch.bfloat16,
    DType.kInt32: torch.int32,
    DType.kByte: torch.uint8,
}


class FP8TensorMeta:
    """The FP8 scaling state holder; only FP8 recipes (refused on a CPU) fill it."""

    def __init__(self) -> None:
        self.scale = torch.ones(0)
        self.amax_history = torch.zeros(0)


class _Refused:
    """A userbuffers communicator class: TE's comm/GEMM overlap needs CUDA peer memory."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        raise NotImplementedError("Transformer Engine userbuffers overlap needs CUDA (refused on CPU)")


CommOverlapCore = CommOverlapBase = CommOverlapP2PBase = CommOverlap = CommOverlapP2P = _Refused
CommOverlapHelper = _Refused


def _plain(tensor: Any, quantizer: Any = None) -> torch.Tensor:
    """``tensor`` as a plain torch tensor; a quantised tensor or output quantizer is refused."""
    if quantizer is not None:
        raise NotImplementedError(
            f"{type(quantizer).__name__}: FP8/FP4 quantisation is refused on a CPU"
        )
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        if hasattr(tensor, "dequantize"):
            raise NotImplementedError(
                f"{type(tensor).__name__}: FP8/FP4 tensors are refused on a CPU"
            )
    return tensor


def _out_dtype(dtype: Any, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    return _TORCH_DTYPE[DType(int(dtype))]


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value.reshape(out.shape))
    return out


# --- device and library queries -------------------------------------------------------------


def get_cublasLt_version() -> int:
    """cuBLASLt's version: TE checks it for features newer than 12.x; none run here."""
    return 120000


def get_cudnn_version() -> int:
    """cuDNN's version, encoded as ``cudnnGetVersion`` returns it (9.12.0)."""
    return 91200


def get_num_cublas_streams() -> int:
    """cuBLAS streams TE may use: CPU ops run on one."""
    return 1


def device_supports_multicast(device_id: int = -1) -> bool:
    """NVLink multicast: never on a CPU."""
    return False


def get_stream_priority_range(device_id: int = -1) -> tuple[int, int]:
    """CUDA stream priorities (low, high): one priority."""
    return 0, 0


def ubuf_built_with_mpi() -> bool:
    """Userbuffers bootstrapped by MPI: no userbuffers here."""
    return False


def nvte_built_with_cublasmp() -> bool:
    """cuBLASMp backend: absent."""
    return False


# --- GEMM ------------------------------------------------------------------------------------


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _dgelu_tanh(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        leaf = x.detach().float().requires_grad_()
        (derivative,) = torch.autograd.grad(_gelu_tanh(leaf).sum(), leaf)
    return (grad.float() * derivative).to(grad.dtype)


def generic_gemm(A: Any, transA: bool, B: Any, transB: bool, D: torch.Tensor | None,
                 quantizer: Any, output_dtype: Any, bias: torch.Tensor | None, bias_type: Any,
                 gelu: bool, gelu_in: torch.Tensor | None, grad: bool, workspace: Any,
                 workspace_size: int, accumulate: bool, use_split_accumulator: bool,
                 comm_overlap: Any = None, comm_type: Any = None, extra_output: Any = None,
                 bulk_overlap: bool = False, alpha: float = 1.0, beta: float | None = None,
                 ) -> list[torch.Tensor | None]:
    """cuBLAS's column-major ``D = op(A) op(B)``: row-major ``D = op(B) @ op(A)^T``.

    ``transA``/``transB`` as in TE's layouts: TN (forward, ``B @ A^T``), NN (data gradient,
    ``B @ A``), NT (weight gradient, ``B^T @ A``). Leading dims of B (or of both in NT) are
    flattened. With ``grad``, a given bias receives B's column sums and ``gelu`` multiplies by
    GeLU's derivative at ``gelu_in``; without, the bias is added and ``gelu`` returns the
    pre-activation too. Returns ``[D, bias_grad, pre_gelu, extra_output]``.
    """
    if comm_overlap is not None:
        raise NotImplementedError("Transformer Engine userbuffers overlap needs CUDA (refused on CPU)")
    A, B = _plain(A), _plain(B)
    _plain(None, quantizer)
    a = A.reshape(-1, A.shape[-1])
    b = B.reshape(-1, B.shape[-1])
    a = a.t() if transA else a  # [k, n]
    b = b.t() if transB else b  # [m, k]
    result = (b.float() @ a.float()) * alpha
    out_shape = (list(B.shape[:-1]) if not transB else [B.shape[-1]]) + [a.shape[1]]
    bias_grad = None
    pre_gelu = None
    if grad:
        if bias is not None:
            bias_grad = B.reshape(-1, B.shape[-1]).float().sum(0).to(bias.dtype)
        if gelu:
            result = _dgelu_tanh(result, gelu_in.reshape(result.shape)).float()
    else:
        if bias is not None:
            result = result + bias.float()
        if gelu:
            pre_gelu = result
            result = _gelu_tanh(result)
    dtype = _out_dtype(output_dtype, D.dtype if D is not None else A.dtype)
    result = result.reshape(out_shape)
    if accumulate:
        if D is None:
            raise ValueError("accumulate needs an output tensor")
        D.copy_((D.float() * (1.0 if beta is None else beta) + result).to(D.dtype))
        out = D
    else:
        out = _into(D, result.to(dtype))
    if pre_gelu is not None:
        pre_gelu = _into(gelu_in, pre_gelu.reshape(out_shape).to(dtype))
    return [out, bias_grad, pre_gelu, extra_output]


# --- normalisation ----------------------------------------------------------------------------


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    return weight.float() + 1 if zero_centered_gamma else weight.float()


def layernorm_fwd(input: Any, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                  ln_out: torch.Tensor | None, quantizer: Any, out_dtype: Any, sm_margin: int,
                  zero_centered_gamma: bool) -> list[torch.Tensor]:
    """LayerNorm over the last dim in fp32: ``[y, mean, rsigma]`` (statistics per row, fp32)."""
    x = _plain(input, quantizer)
    rows = x.reshape(-1, x.shape[-1]).float()
    mu = rows.mean(-1)
    rsigma = torch.rsqrt(rows.var(-1, unbiased=False) + eps)
    y = (rows - mu[:, None]) * rsigma[:, None] * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    y = y.reshape(x.shape).to(_out_dtype(out_dtype, x.dtype))
    return [_into(ln_out, y), mu, rsigma]


def layernorm_bwd(dz: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor,
                  gamma: torch.Tensor, sm_margin: int, zero_centered_gamma: bool
                  ) -> list[torch.Tensor]:
    """LayerNorm's backward: ``[dx, dgamma, dbeta]``."""
    rows = x.reshape(-1, x.shape[-1]).float()
    dy = dz.reshape(rows.shape).float()
    xhat = (rows - mu[:, None]) * rsigma[:, None]
    g = dy * _gamma(gamma, zero_centered_gamma)
    dx = rsigma[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dgamma = (dy * xhat).sum(0).to(gamma.dtype)
    return [dx.reshape(x.shape).to(x.dtype), dgamma, dy.sum(0).to(gamma.dtype)]


def rmsnorm_fwd(input: Any, weight: torch.Tensor, eps: float, ln_out: torch.Tensor | None,
                quantizer: Any, otype: Any, sm_margin: int, zero_centered_gamma: bool
                ) -> list[torch.Tensor | None]:
    """RMSNorm over the last dim in fp32: ``[y, None, rsigma]``."""
    x = _plain(input, quantizer)
    rows = x.reshape(-1, x.shape[-1]).float()
    rsigma = torch.rsqrt(rows.pow(2).mean(-1) + eps)
    y = rows * rsigma[:, None] * _gamma(weight, zero_centered_gamma)
    y = y.reshape(x.shape).to(_out_dtype(otype, x.dtype))
    return [_into(ln_out, y), None, rsigma]


def rmsnorm_bwd(dz: torch.Tensor, x: torch.Tensor, rsigma: torch.Tensor, gamma: torch.Tensor,
                sm_margin: int, zero_centered_gamma: bool) -> list[torch.Tensor]:
    """RMSNorm's backward: ``[dx, dgamma]``."""
    rows = x.reshape(-1, x.shape[-1]).float()
    dy = dz.reshape(rows.shape).float()
    xhat = rows * rsigma[:, None]
    g = dy * _gamma(gamma, zero_centered_gamma)
    dx = rsigma[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return [dx.reshape(x.shape).to(x.dtype), (dy * xhat).sum(0).to(gamma.dtype)]


def rmsnorm_bwd_add(dz: torch.Tensor, x: torch.Tensor, add: torch.Tensor, rsigma: torch.Tensor,
                    gamma: torch.Tensor, sm_margin: int, zero_centered_gamma: bool
                    ) -> list[torch.Tensor]:
    """RMSNorm's backward with a gradient added to dx: ``[dx + add, dgamma]``."""
    dx, dgamma = rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma)
    return [(dx.float() + add.float()).to(dx.dtype), dgamma]


# --- activations ------------------------------------------------------------------------------


def _qgelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).pow(2)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu_tanh,
    "qgelu": _qgelu,
    "relu": torch.relu,
    "srelu": _srelu,
    "silu": F.silu,
}
# Gated forms: the input's last dim holds [activation input, linear gate] halves.
_GATED = {"glu": torch.sigmoid, "geglu": _gelu_tanh, "qgeglu": _qgelu, "reglu": torch.relu,
          "sreglu": _srelu, "swiglu": F.silu}


def _activation(fn: Callable[[torch.Tensor], torch.Tensor], gated: bool) -> Callable[..., Any]:
    def forward(input: torch.Tensor, quantizer: Any = None) -> torch.Tensor:
        x = _plain(input, quantizer).float()
        if gated:
            act, gate = x.chunk(2, dim=-1)
            return (fn(act) * gate).to(input.dtype)
        return fn(x).to(input.dtype)

    return forward


def _activation_backward(forward: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def backward(grad: torch.Tensor, input: torch.Tensor, quantizer: Any = None) -> torch.Tensor:
        _plain(None, quantizer)
        with torch.enable_grad():
            leaf = input.detach().float().requires_grad_()
            (dx,) = torch.autograd.grad(forward(leaf), leaf, grad.float())
        return dx.to(input.dtype)

    return backward


def _dbias(backward: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def dbias_backward(grad_output: torch.Tensor, act_input: torch.Tensor, quantizer: Any = None
                       ) -> list[torch.Tensor]:
        dx = backward(grad_output, act_input, quantizer)
        return [dx.reshape(-1, dx.shape[-1]).float().sum(0).to(dx.dtype), dx]

    return dbias_backward


for _name, _fn in (*_ACTIVATIONS.items(), *_GATED.items()):
    globals()[_name] = _activation(_fn, _name in _GATED)
    globals()[f"d{_name}"] = _activation_backward(globals()[_name])
for _name in _ACTIVATIONS:
    globals()[f"dbias_d{_name}"] = _dbias(globals()[f"d{_name}"])


def clamped_swiglu(input: torch.Tensor, quantizer: Any, limit: float, alpha: float) -> torch.Tensor:
    """GPT-OSS SwiGLU: ``min(a, limit) * sigmoid(alpha * a) * (clamp(g, -limit, limit) + 1)``."""
    x = _plain(input, quantizer).float()
    act, gate = x.chunk(2, dim=-1)
    act = act.clamp(max=limit)
    return (act * torch.sigmoid(alpha * act) * (gate.clamp(-limit, limit) + 1)).to(input.dtype)


def clamped_dswiglu(grad: torch.Tensor, input: torch.Tensor, quantizer: Any, limit: float,
                    alpha: float) -> torch.Tensor:
    """The backward of :func:`clamped_swiglu`."""
    return _activation_backward(lambda x: clamped_swiglu(x, None, limit, alpha))(grad, input)


# --- softmax (unfused attention) -------------------------------------------------------------


def _softmax(scores: torch.Tensor, scale: float, masked: torch.Tensor | None) -> torch.Tensor:
    x = scores.float() * scale
    if masked is not None:
        x = x.masked_fill(masked, -10000.0)
    return torch.softmax(x, dim=-1).to(scores.dtype)


def _softmax_backward(grad: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    g, p = grad.float(), probs.float()
    return (scale * p * (g - (g * p).sum(-1, keepdim=True))).to(grad.dtype)


def _causal(scores: torch.Tensor, aligned_bottom_right: bool) -> torch.Tensor:
    sq, sk = scores.shape[-2:]
    offset = sk - sq if aligned_bottom_right else 0
    return torch.ones(sq, sk, dtype=torch.bool).triu(1 + offset)


def scaled_softmax_forward(input: torch.Tensor, scale_factor: float) -> torch.Tensor:
    """``softmax(scale * x)`` over the last dim."""
    return _softmax(input, scale_factor, None)


def scaled_masked_softmax_forward(input: torch.Tensor, mask: torch.Tensor, scale_factor: float
                                  ) -> torch.Tensor:
    """Masked positions (``mask`` true) get -10000 before the softmax, as TE's kernel does."""
    return _softmax(input, scale_factor, mask.bool())


def scaled_upper_triang_masked_softmax_forward(input: torch.Tensor, scale_factor: float
                                               ) -> torch.Tensor:
    """Causal (top-left aligned) masked softmax."""
    return _softmax(input, scale_factor, _causal(input, False))


def scaled_aligned_causal_masked_softmax_forward(input: torch.Tensor, scale_factor: float
                                                 ) -> torch.Tensor:
    """Causal masked softmax aligned to the bottom-right corner."""
    return _softmax(input, scale_factor, _causal(input, True))


scaled_softmax_backward = scaled_masked_softmax_backward = _softmax_backward
scaled_upper_triang_masked_softmax_backward = _softmax_backward
scaled_aligned_causal_masked_softmax_backward = _softmax_backward


# --- fused attention --------------------------------------------------------------------------

_FORMAT_DIMS = {"sbhd": (1, 0, 2, 3), "bshd": (0, 1, 2, 3)}  # -> [b, s, h, d]
# thd: packed sequences [t, h, d], each sequence's rows given by cu_seqlens (and their _padded)
_FORMATS = frozenset({*_FORMAT_DIMS, "thd"})


def _layout_format(layout: Any) -> str:
    """The q/k/v format of a layout: Q, K and V arrive as separate tensors in it, also when
    they are views of one packed buffer (``sb3hd``, ``sbhd_sb2hd``, ``th3d``, ...)."""
    name = NVTE_QKV_Layout(int(layout)).name
    formats = {"".join(c for c in part if not c.isdigit()).lower()
               for part in name.removeprefix("NVTE_").split("_")}
    if len(formats) != 1 or not formats <= _FORMATS:
        raise NotImplementedError(f"fused attention layout {name} is not implemented on a CPU")
    return formats.pop()


def _format_of(tensor_format: Any, layout_format: str) -> str:
    """The format an output or its gradient comes in: ``tensor_format``, else the layout's."""
    name = NVTE_QKV_Format(int(tensor_format)).name.removeprefix("NVTE_").lower()
    fmt = name if name in _FORMATS else layout_format
    if "thd" in (fmt, layout_format) and fmt != layout_format:
        raise NotImplementedError(f"fused attention from {layout_format} to {fmt} is not implemented on a CPU")
    return fmt


def _to_bhsd(t: torch.Tensor, fmt: str) -> torch.Tensor:
    return t.permute(*_FORMAT_DIMS[fmt]).transpose(1, 2).float()


def _from_bhsd(t: torch.Tensor, fmt: str) -> torch.Tensor:
    bshd = t.transpose(1, 2)
    return bshd.transpose(0, 1) if fmt == "sbhd" else bshd


def _sequence_to_bhsd(t: torch.Tensor) -> torch.Tensor:
    """One packed sequence's rows ``[s, h, d]`` as a batch of one ``[1, h, s, d]``, in fp32."""
    return t.permute(1, 0, 2)[None].float()


def _sequence_from_bhsd(t: torch.Tensor) -> torch.Tensor:
    return t[0].permute(1, 0, 2)


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
               padded_q: torch.Tensor | None, padded_kv: torch.Tensor | None,
               max_seqlen_q: int, max_seqlen_kv: int) -> list[tuple[slice, slice]]:
    """Packed sequences (thd): each sequence's rows of Q and of K/V, its length from
    ``cu_seqlens`` and its start from the ``_padded`` offsets (``cu_seqlens`` when not given).
    Rows outside every sequence (padding between or after them) attend to nothing. A sequence
    longer than its ``max_seqlen`` is refused: cuDNN sizes its problem by it."""
    def rows(cu: torch.Tensor, padded: torch.Tensor | None, longest: int) -> list[slice]:
        starts = (cu if padded is None else padded)[:-1].tolist()
        lengths = (cu[1:] - cu[:-1]).tolist()
        if max(lengths, default=0) > longest:
            raise ValueError(f"fused attention: a packed sequence of {max(lengths)} tokens exceeds "
                             f"max_seqlen {longest}")
        return [slice(start, start + length) for start, length in zip(starts, lengths, strict=True)]

    return list(zip(rows(cu_seqlens_q, padded_q, max_seqlen_q),
                    rows(cu_seqlens_kv, padded_kv, max_seqlen_kv), strict=True))


def _packed_rows(pieces: list[tuple[slice, torch.Tensor]], total: int, fill: float) -> torch.Tensor:
    """Each sequence's rows ``(rows, [s, ...])`` joined into the packed buffer of ``total`` rows
    in one ``cat`` (so the result derives from the pieces, for the type checker too), ``fill``
    in the rows outside every sequence."""
    parts, end = [], 0
    for rows, piece in sorted(pieces, key=lambda entry: entry[0].start):
        if rows.start > end:
            parts.append(piece.new_full((rows.start - end, *piece.shape[1:]), fill))
        parts.append(piece)
        end = rows.stop
    if total > end:
        parts.append(pieces[0][1].new_full((total - end, *pieces[0][1].shape[1:]), fill))
    return torch.cat(parts)


def _attention_mask(mask_type: Any, window: Any, sq: int, sk: int, bottom_right: bool
                    ) -> torch.Tensor | None:
    """True where a query (row) may not see a key (column) of one sequence: causal (top-left
    or bottom-right aligned) and the sliding window. Padding is where a sequence ends
    (:func:`_sequences`), checked by :func:`_check_mask`."""
    name = NVTE_Mask_Type(int(mask_type)).name
    offset = sk - sq if ("BOTTOM_RIGHT" in name or bottom_right) else 0
    rows = torch.arange(sq)[:, None] + offset
    cols = torch.arange(sk)[None, :]
    masked = torch.zeros(sq, sk, dtype=torch.bool)
    if "CAUSAL" in name:
        masked |= cols > rows
    left, right = (list(window) + [-1, -1])[:2] if window is not None else (-1, -1)
    if left >= 0:
        masked |= cols < rows - left
    if right >= 0:
        masked |= cols > rows + right
    return masked if masked.any() else None


def _check_mask(fmt: str, mask_type: Any, bias_type: Any) -> None:
    """Padding masks are implemented for packed sequences (thd) only, and those take no bias."""
    if "PADDING" in NVTE_Mask_Type(int(mask_type)).name and fmt != "thd":
        raise NotImplementedError("fused attention with a padding mask is implemented on a CPU "
                                  "only for packed sequences (thd)")
    if fmt == "thd" and NVTE_Bias_Type(int(bias_type)).name != "NVTE_NO_BIAS":
        raise NotImplementedError("fused attention bias on packed sequences (thd) is not implemented on a CPU")


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, masked: torch.Tensor | None,
            bias: torch.Tensor | None) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.float()
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    return s


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1) if t.shape[1] != heads else t


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            masked: torch.Tensor | None, bias: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention on ``[b, h, s, d]`` in fp32: the output, and per query the log-sum-exp and
    the largest of the scaled, masked scores (both ``[b, h, sq, 1]``)."""
    s = _scores(q, k, scale, masked, bias)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    probs = torch.exp(s - lse).nan_to_num(0.0)
    return probs @ _expand_kv(v, q.shape[1]), lse, s.amax(-1, keepdim=True)


def _attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     do: torch.Tensor, lse: torch.Tensor, scale: float,
                     masked: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The backward of :func:`_attend` (without bias) from its log-sum-exp: dq, dk, dv and the
    scores' gradient."""
    heads = q.shape[1]
    probs = torch.exp(_scores(q, k, scale, masked, None) - lse).nan_to_num(0.0)
    dv = probs.transpose(-1, -2) @ do
    dp = do @ _expand_kv(v, heads).transpose(-1, -2)
    ds = probs * (dp - (do * o).sum(-1, keepdim=True))
    dq = ds @ _expand_kv(k, heads) * scale
    dk = ds.transpose(-1, -2) @ q * scale
    groups = heads // k.shape[1]
    if groups > 1:
        dk = dk.unflatten(1, (k.shape[1], groups)).sum(2)
        dv = dv.unflatten(1, (k.shape[1], groups)).sum(2)
    return dq, dk, dv, ds


def _check_attention(p_dropout: float, bias_type: Any, softmax_type: Any) -> None:
    if p_dropout > 0:
        raise NotImplementedError("fused attention with dropout is not implemented on a CPU")
    if NVTE_Softmax_Type(int(softmax_type)).name != "NVTE_VANILLA_SOFTMAX":
        raise NotImplementedError("fused attention with a softmax offset is not implemented on a CPU")
    if NVTE_Bias_Type(int(bias_type)).name not in ("NVTE_NO_BIAS", "NVTE_POST_SCALE_BIAS"):
        raise NotImplementedError("fused attention bias other than post-scale is not implemented")


def fused_attn_fwd(max_seqlen_q: int, max_seqlen_kv: int, is_training: bool, attn_scale: float,
                   p_dropout: float, set_zero: bool, qkv_layout: Any, o_format: Any,
                   qkv_scale_inv_format: Any, bias_type: Any, attn_mask_type: Any,
                   softmax_type: Any, window_size: Any, bottom_right_diagonal: bool,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, Q: Any, K: Any,
                   V: Any, fake_dtype: Any, cu_seqlens_q_padded: Any, cu_seqlens_kv_padded: Any,
                   page_table_k: Any, page_table_v: Any, s_quantizer: Any, o_quantizer: Any,
                   Bias: torch.Tensor | None, SoftmaxOffset: Any, rng_gen: Any,
                   rng_elts_per_thread: int, return_max_logit: bool, cuda_graph: bool
                   ) -> list[Any]:
    """cuDNN's F16 arbitrary-seqlen attention in fp32: ``[O, softmax_lse, (Max,) rng_state]``.

    ``softmax_lse`` is the log-sum-exp of the scaled, masked scores per query (what TE's
    context-parallel ring merges partial outputs with), ``Max`` (with ``return_max_logit``)
    their largest, both ``[b, h, sq, 1]``; a fully masked row has -inf. ``O`` comes in
    ``o_format`` (the layout's own format otherwise). Packed sequences (thd, ``[t, h, d]``)
    attend within each sequence only (:func:`_sequences`); their statistics are ``[t, h, 1]``,
    as newer cuDNN returns them, and rows outside every sequence get a zero output.
    """
    _check_attention(p_dropout, bias_type, softmax_type)
    fmt = _layout_format(qkv_layout)
    _check_mask(fmt, attn_mask_type, bias_type)
    Q, K, V = (_plain(t) for t in (Q, K, V))
    out_fmt = _format_of(o_format, fmt)
    if fmt == "thd":
        pieces: list[list[tuple[slice, torch.Tensor]]] = [[], [], []]  # out, lse, peak
        for rows_q, rows_kv in _sequences(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                          cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv):
            q, k, v = (_sequence_to_bhsd(t) for t in (Q[rows_q], K[rows_kv], V[rows_kv]))
            masked = _attention_mask(attn_mask_type, window_size, q.shape[2], k.shape[2],
                                     bottom_right_diagonal)
            for kept, part in zip(pieces, _attend(q, k, v, attn_scale, masked, None), strict=True):
                kept.append((rows_q, _sequence_from_bhsd(part)))
        out, lse, peak = (_packed_rows(kept, Q.shape[0], fill)
                          for kept, fill in zip(pieces, (0.0, float("-inf"), float("-inf")), strict=True))
    else:
        q, k, v = (_to_bhsd(t, fmt) for t in (Q, K, V))
        masked = _attention_mask(attn_mask_type, window_size, q.shape[2], k.shape[2],
                                 bottom_right_diagonal)
        out, lse, peak = _attend(q, k, v, attn_scale, masked, Bias)
        out = _from_bhsd(out, out_fmt)
    result: list[Any] = [out.contiguous().to(Q.dtype), lse]
    if return_max_logit:
        result.append(peak)
    return [*result, torch.zeros(2, dtype=torch.int64)]


def fused_attn_bwd(max_seqlen_q: int, max_seqlen_kv: int, attn_scale: float, p_dropout: float,
                   set_zero: bool, qkv_layout: Any, o_format: Any, do_format: Any,
                   dqkv_layout: Any, qkv_scale_inv_format: Any, do_scale_inv_format: Any,
                   bias_type: Any, attn_mask_type: Any, softmax_type: Any, window_size: Any,
                   bottom_right_diagonal: bool, deterministic: bool,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, Q: Any, K: Any,
                   V: Any, O: Any, dO: Any, fake_dtype: Any,  # noqa: E741
                   Aux_CTX_Tensors: list[torch.Tensor],
                   cu_seqlens_q_padded: Any, cu_seqlens_kv_padded: Any, s_quantizer: Any,
                   dp_quantizer: Any, dqkv_quantizer: Any, cuda_graph: bool) -> list[Any]:
    """The backward of :func:`fused_attn_fwd` from its saved log-sum-exp: ``[dQ, dK, dV, dBias, dSoftmaxOffset]``."""
    _check_attention(p_dropout, bias_type, softmax_type)
    fmt = _layout_format(qkv_layout)
    _check_mask(fmt, attn_mask_type, bias_type)
    Q, K, V, O, dO = (_plain(t) for t in (Q, K, V, O, dO))  # noqa: E741
    lse = Aux_CTX_Tensors[0].float()
    if fmt == "thd":
        pieces: list[list[tuple[slice, torch.Tensor]]] = [[], [], []]  # dq, dk, dv
        for rows_q, rows_kv in _sequences(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                          cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv):
            q, k, v, o, do, stats = (_sequence_to_bhsd(t[rows]) for t, rows in (
                (Q, rows_q), (K, rows_kv), (V, rows_kv), (O, rows_q), (dO, rows_q), (lse, rows_q)))
            masked = _attention_mask(attn_mask_type, window_size, q.shape[2], k.shape[2],
                                     bottom_right_diagonal)
            grads_of_sequence = _attend_backward(q, k, v, o, do, stats, attn_scale, masked)[:3]
            for kept, rows, part in zip(pieces, (rows_q, rows_kv, rows_kv), grads_of_sequence, strict=True):
                kept.append((rows, _sequence_from_bhsd(part)))
        grads = [_packed_rows(kept, t.shape[0], 0.0) for kept, t in zip(pieces, (Q, K, V), strict=True)]
        dbias = None
    else:
        q, k, v = (_to_bhsd(t, fmt) for t in (Q, K, V))
        o = _to_bhsd(O, _format_of(o_format, fmt))
        do = _to_bhsd(dO, _format_of(do_format, fmt))
        masked = _attention_mask(attn_mask_type, window_size, q.shape[2], k.shape[2],
                                 bottom_right_diagonal)
        dq, dk, dv, ds = _attend_backward(q, k, v, o, do, lse, attn_scale, masked)
        grads = [_from_bhsd(g, fmt) for g in (dq, dk, dv)]
        with_bias = NVTE_Bias_Type(int(bias_type)).name != "NVTE_NO_BIAS"
        dbias = ds.sum(0, keepdim=True).to(Q.dtype) if with_bias else None
    return [*(g.contiguous().to(t.dtype) for g, t in zip(grads, (Q, K, V), strict=True)), dbias, None]


def convert_thd_to_bshd(tensor: torch.Tensor, cu_seqlens: torch.Tensor, b: int, max_seq_len: int
                        ) -> torch.Tensor:
    """Packed sequences ``[t, h, d]`` as a zero-padded batch ``[b, max_seq_len, h, d]`` (TE's
    unfused attention on thd)."""
    out = tensor.new_zeros(b, max_seq_len, *tensor.shape[1:])
    for i, (start, end) in enumerate(zip(cu_seqlens[:b].tolist(), cu_seqlens[1:b + 1].tolist(),
                                         strict=True)):
        if end - start > max_seq_len:
            raise ValueError(f"convert_thd_to_bshd: a packed sequence of {end - start} tokens "
                             f"exceeds max_seqlen {max_seq_len}")
        out[i, :end - start] = tensor[start:end]
    return out


def convert_bshd_to_thd(tensor: torch.Tensor, cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """A padded batch ``[b, s, h, d]`` packed back into ``t`` rows ``[t, h, d]``: the inverse
    of :func:`convert_thd_to_bshd` (zeros where no sequence is)."""
    out = tensor.new_zeros(t, *tensor.shape[2:])
    b = tensor.shape[0]
    for i, (start, end) in enumerate(zip(cu_seqlens[:b].tolist(), cu_seqlens[1:b + 1].tolist(),
                                         strict=True)):
        out[start:end] = tensor[i, :end - start]
    return out


def get_fused_attn_backend(params: Any) -> tuple[Any, str]:
    """The F16 arbitrary-seqlen backend when :func:`fused_attn_fwd` covers ``params``.

    Otherwise ``NVTE_No_Backend`` with the reason, and TE picks another backend (its unfused
    attention, plain torch) as it would on a GPU without that support.
    """
    reason = ""
    try:
        _check_attention(params.dropout, params.bias_type, params.softmax_type)
        _check_mask(_layout_format(params.qkv_layout), params.attn_mask_type, params.bias_type)
        if params.head_dim_qk != params.head_dim_v:
            reason = "different q/k and v head dims are not implemented on a CPU"
    except NotImplementedError as why:
        reason = str(why)
    if reason:
        return NVTE_Fused_Attn_Backend.NVTE_No_Backend, reason
    return NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen, ""


# --- everything else --------------------------------------------------------------------------


def _refusing(name: str) -> Callable[..., Any]:
    def refused(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError(
            f"transformer_engine_torch.{name} has no CPU implementation in shardcheck "
            "(FP8/FP4, userbuffers and CUDA-only paths are refused)"
        )

    refused.__name__ = name
    return refused


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _refusing(name)
