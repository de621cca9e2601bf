"""State-space layers: Megatron's Gated DeltaNet and Mamba-2 mixer, one training step each.

The CUDA kernels they call are replaced by the plain-torch ones of
:mod:`shardcheck.megatron.cpu.kernels` (CPU patch ``ssm_kernels``). The layer runs wrapped in
Megatron's DistributedDataParallel on a [seq, batch, hidden] input (the batch split over data
parallelism; the sequence over context parallelism in Megatron's load-balanced chunk order,
then over tensor parallelism under sequence parallelism), with the loss
``sum(output * upstream) / batch`` (times the cp size for the backward, as Megatron's schedules
do, since the gradient all-reduce averages over dp x cp; with ``calculate_per_token_loss``
divided by the dp size instead, since DDP then sums); then ``finalize_model_grads`` and,
as outputs, global values only: the loss, the layer's output, the input's gradient, every
parameter's gradient and the largest disagreement between replicas of a gradient (0 on one
rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from shardcheck.megatron.cpu.parallel import (
    LayoutUnsupported,
    explicit_kwargs,
    megatron_parallel,
    world_group,
)
from shardcheck.megatron.scenarios.gpt import GPTSetup, transformer_config
from shardcheck.megatron.scenarios.reference import (
    check_gradients_where_built,
    gather_global,
    gradient_of,
    load_global_weights,
    seeded_global,
)


@dataclass(frozen=True)
class GDNSetup:
    """Sizes and options of the Gated DeltaNet scenario; ``config`` overrides TransformerConfig."""

    hidden: int = 16
    seq: int = 8
    batch: int = 2
    key_heads: int = 4
    value_heads: int = 8
    head_dim: int = 4
    conv_kernel: int = 4
    use_qk_l2norm: bool = True
    bias: bool = False
    conv_bias: bool = False
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    # Megatron's local linear and norm modules, or Transformer Engine's ("te": those of its
    # hybrid spec, the input norm fused into in_proj; see GPTSetup.impl)
    impl: Literal["local", "te"] = "local"


def _gdn_config(layout: Any, setup: GDNSetup):
    return transformer_config(
        layout, GPTSetup(hidden=setup.hidden, heads=4, layers=1, config=setup.config),
        experimental_attention_variant="gated_delta_net", linear_attention_freq=1,
        linear_conv_kernel_dim=setup.conv_kernel, linear_key_head_dim=setup.head_dim,
        linear_value_head_dim=setup.head_dim, linear_num_key_heads=setup.key_heads,
        linear_num_value_heads=setup.value_heads, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm")


def _build_gdn(config, setup: GDNSetup, pg: Any = None):
    """GatedDeltaNet with Megatron's local linear and norm modules, or Transformer Engine's."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

    if setup.impl == "te":
        from megatron.core.extensions import transformer_engine as te

        submodules = GatedDeltaNetSubmodules(in_proj=te.TELayerNormColumnParallelLinear,
                                             out_norm=te.TENorm, out_proj=te.TERowParallelLinear)
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                             out_proj=RowParallelLinear)
    return GatedDeltaNet(config, submodules, layer_number=1, bias=setup.bias,
                         conv_bias=setup.conv_bias, use_qk_l2norm=setup.use_qk_l2norm,
                         pg_collection=pg or ProcessGroupCollection.use_mpu_process_groups())


def gdn_step(ctx: Any, setup: GDNSetup) -> dict[str, torch.Tensor]:
    """One training step of Megatron's GatedDeltaNet under ``ctx``'s layout; global values."""
    return _train_step(ctx, setup, lambda: _gdn_config(ctx.layout, setup), _build_gdn,
                       attention_mask=None)


@dataclass(frozen=True)
class MambaSetup:
    """Sizes and options of the Mamba-2 mixer scenario; ``config`` overrides TransformerConfig."""

    hidden: int = 16
    seq: int = 8
    batch: int = 2
    expand: int = 2
    head_dim: int = 4
    state_dim: int = 4
    groups: int = 8
    conv_kernel: int = 4
    rmsnorm: bool = True
    d_has_hdim: bool = False
    conv_bias: bool = True
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    impl: Literal["local", "te"] = "local"  # as GDNSetup.impl


def _mamba_config(layout: Any, setup: MambaSetup):
    return transformer_config(
        layout, GPTSetup(hidden=setup.hidden, heads=4, layers=1, config=setup.config),
        mamba_state_dim=setup.state_dim, mamba_head_dim=setup.head_dim,
        mamba_num_groups=setup.groups)


def _build_mamba(config, setup: MambaSetup, pg: Any = None):
    """MambaMixer with Megatron's local linear modules, or Transformer Engine's."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules

    if setup.impl == "te":
        from megatron.core.extensions import transformer_engine as te

        submodules = MambaMixerSubmodules(in_proj=te.TELayerNormColumnParallelLinear,
                                          out_proj=te.TERowParallelLinear)
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        submodules = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
    return MambaMixer(config, submodules, d_model=setup.hidden, d_conv=setup.conv_kernel,
                      expand=setup.expand, D_has_hdim=setup.d_has_hdim, rmsnorm=setup.rmsnorm,
                      conv_bias=setup.conv_bias, layer_number=1,
                      pg_collection=pg or ProcessGroupCollection.use_mpu_process_groups())


def check_mamba_layout(layout: Any) -> None:
    """Refuse what the Mamba scenario cannot run as Megatron would (see :func:`_check_layout`),
    and explicit groups on the releases whose mixer disagrees with one rank there for a reason
    not pinned down yet (``versions.mamba_takes_conv_module``)."""
    from shardcheck.megatron.cpu.versions import mamba_takes_conv_module

    _check_layout(layout)
    if layout.explicit_groups and mamba_takes_conv_module():
        raise LayoutUnsupported("this release's MambaMixer (MambaContextParallel taking the conv1d "
                                "module, 0.16) disagrees with one rank under explicit groups for a "
                                "reason not pinned down yet; 0.19 runs them")


def mamba_step(ctx: Any, setup: MambaSetup) -> dict[str, torch.Tensor]:
    """One training step of Megatron's Mamba-2 mixer under ``ctx``'s layout; global values."""
    check_mamba_layout(ctx.layout)
    return _train_step(ctx, setup, lambda: _mamba_config(ctx.layout, setup), _build_mamba)


# ---- shared by the SSM layers ----------------------------------------------------------------

def _check_layout(layout: Any) -> None:
    if layout.pp > 1:
        raise LayoutUnsupported("a single SSM layer has no pipeline stages")


def _split(tensor: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    return tensor.chunk(size, dim=dim)[rank]


def _gather(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _axis(pg: Any, name: str) -> dist.ProcessGroup:
    """The group of an axis (tp, cp, dp, tp_cp): the explicit collection's, else parallel_state's."""
    from megatron.core import parallel_state as ps

    if pg is not None:
        return getattr(pg, name)
    return {"tp": ps.get_tensor_model_parallel_group, "cp": ps.get_context_parallel_group,
            "dp": ps.get_data_parallel_group, "tp_cp": ps.get_tensor_and_context_parallel_group}[name]()


def _size_rank(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _cp_positions(seq: int, pg: Any = None) -> torch.Tensor | None:
    """The global sequence positions of this CP rank (None without context parallelism)."""
    from shardcheck.megatron.cpu.cp_attention import load_balanced_positions

    cp, rank = _size_rank(_axis(pg, "cp"))
    if cp == 1:
        return None
    return load_balanced_positions(seq // cp, rank, cp)


def _local_input(name: str, setup: Any, sp: bool, pg: Any = None) -> torch.Tensor:
    """This rank's part of a global [seq, batch, hidden] tensor: batch over dp, seq over cp
    (load-balanced chunks), then over tp under SP, by the ranks of the model's groups."""
    full = seeded_global(name, (setup.seq, setup.batch, setup.hidden), setup.seed).float() * 20
    local = _split(full, 1, *_size_rank(_axis(pg, "dp")))
    positions = _cp_positions(setup.seq, pg)
    if positions is not None:
        local = local[positions]
    if sp:
        local = _split(local, 0, *_size_rank(_axis(pg, "tp")))
    return _typed_input(local.contiguous(), sp)


def _typed_input(local: torch.Tensor, sp: bool) -> torch.Tensor:
    """Tell an active type checker how the input was cut: V over dp (each data-parallel rank
    has its own samples, as Megatron's batches), S(0) over cp (load-balanced order) and, under
    sequence parallelism, each cp piece over tp: nested by the mesh's rank order, which
    explicit groups may reverse (tp2-cp2-sp@cp-tp)."""
    import shardcheck as sc
    from shardcheck.typecheck.checker import current
    from shardcheck.typecheck.types import V

    checker = current()
    if checker is None:
        return local
    cuts = [a for a in ("cp", "tp") if a in checker.names and (sp or a == "cp")]
    placements = {"dp": V, **checker.mesh.nested(0, *cuts)}
    return sc.annotate(local, **{a: p for a, p in placements.items() if a in checker.names})


def _global(tensor: torch.Tensor, sp: bool, seq: int, pg: Any = None) -> torch.Tensor:
    """The global [seq, batch, ...] tensor from this rank's part (inverse of :func:`_local_input`)."""
    if sp:
        tensor = _gather(tensor, 0, _axis(pg, "tp"))
    positions = _cp_positions(seq, pg)
    if positions is not None:
        group = _axis(pg, "cp")
        parts = _gather(tensor, 0, group).chunk(dist.get_world_size(group))
        every = _gather(positions, 0, group).chunk(dist.get_world_size(group))
        tensor = torch.empty(seq, *tensor.shape[1:], dtype=tensor.dtype)
        for where, part in zip(every, parts, strict=True):
            tensor[where] = part
    return _gather(tensor, 1, _axis(pg, "dp"))


def _reported_loss(loss: torch.Tensor, sp: bool, pg: Any = None) -> torch.Tensor:
    """The global loss: the sum over the sequence's holders, the mean over dp's batch means."""
    total = loss.detach().clone()
    dist.all_reduce(total, group=_axis(pg, "tp_cp" if sp else "cp"))
    dist.all_reduce(total, group=_axis(pg, "dp"))
    return total / dist.get_world_size(_axis(pg, "dp"))


def _train_step(ctx: Any, setup: Any, make_config: Callable[[], Any],
                build: Callable[[Any, Any, Any], torch.nn.Module], **forward_kwargs: Any,
                ) -> dict[str, torch.Tensor]:
    """One step of an SSM layer through DDP and ``finalize_model_grads``; under explicit
    groups the layer, DDP and ``finalize_model_grads`` get the explicit collection."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    _check_layout(ctx.layout)
    with megatron_parallel(ctx) as pg:
        config = make_config()
        layer = build(config, setup, pg)
        load_global_weights(layer, seed=setup.seed)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), layer,
                                      **explicit_kwargs(pg))
        ddp.zero_grad_buffer()
        sp = ctx.layout.sp
        hidden = _local_input("hidden", setup, sp, pg).requires_grad_(True)
        output, bias = layer(hidden, **forward_kwargs)  # DDP's forward only calls it
        if bias is not None:
            output = output + bias
        upstream = _local_input("upstream", setup, sp, pg)
        loss = (output * upstream).sum() / hidden.shape[1]
        dp, cp = dist.get_world_size(_axis(pg, "dp")), dist.get_world_size(_axis(pg, "cp"))
        # As Megatron's schedules and DDP: a per-token loss is normalised by the global count
        # and summed over dp x cp; otherwise each rank's mean is scaled by the cp size and the
        # gradients averaged over dp x cp.
        scale = 1 / dp if config.calculate_per_token_loss else cp
        (loss * scale).backward()
        finalize_model_grads([ddp], **explicit_kwargs(pg))
        check_gradients_where_built(layer)
        grads, spread = gather_global(layer, gradient_of, world_group(ctx))
        input_grad = hidden.grad / (dp * scale)  # the gradient of the global batch mean
        return {"loss": _reported_loss(loss, sp, pg), "output": _global(output.detach(), sp, setup.seq, pg),
                "input_grad": _global(input_grad, sp, setup.seq, pg),
                "grad_replica_spread": torch.tensor(max(spread.values())),
                **{f"grad/{k}": v for k, v in grads.items()}}

