"""Run Megatron's own training loop (``megatron.training.pretrain``) on a CPU with Gloo.

On top of the model-level patches of :mod:`shardcheck.megatron.cpu.patches`, the training package
assumes CUDA in a few more places, none of which touches the numbers it computes (1-7); and the
paths a CPU run takes instead of a GPU job's (torch's Adam for TE's fused one, float32 for bf16)
hold two megatron-core bugs that stop or change a resumed run (8-9):

1. ``typing_override``: ``megatron.training.models`` imports ``typing.override``, new in Python
   3.12; on 3.11 it is the identity decorator it is at run time on 3.12.
2. ``allow_no_cuda``: ``pretrain`` calls ``initialize_megatron`` without ``allow_no_cuda``,
   which then asserts ``torch.cuda.is_available()``; it is called with ``allow_no_cuda=True``.
3. ``device_count``: ``_initialize_distributed`` builds Megatron's parallel groups only when
   ``torch.cuda.device_count() > 0``; it reports one device, and ``torch.cuda.set_device`` is a
   no-op (there is no device to select).
4. ``device_arch``: argument validation reads the GPU generation from
   ``get_device_arch_version`` (``torch.cuda.get_device_properties``); it reports Hopper (9),
   whose only consequence is that TP/CP need ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which is set
   (left unset for FSDP, which asserts more than one; a CPU has no CUDA streams to connect).
4b. ``nccl_options``: some groups (FSDP's data-parallel one) are built with NCCL communicator
   options (``parallel_state.get_nccl_options``: ``ProcessGroupNCCL.Options``, which a CPU
   torch lacks); Gloo's groups take none.
5. ``dataset_helpers``: ``initialize_megatron`` runs ``make`` in megatron-core's dataset folder
   to build ``helpers_cpp``; the wheel ships it prebuilt, so the build is skipped when it imports.
6. ``eager_fusions``: Megatron's fused elementwise functions are wrapped in ``torch.compile``,
   and initialisation warms them up; on a CPU that compiles C++ for minutes in every rank.
   Dynamo is disabled so they run as the plain functions they wrap, in every layout alike, and
   the warm-up is skipped: its ``torch.rand(..., device="cuda")`` inputs, whose shapes depend
   on the layout, would otherwise draw from the CPU generator (the ``rng`` patch makes the
   CUDA one the CPU one) that ``--use-cpu-initialization`` then initialises the weights from,
   so every layout would start from different weights.

7. ``process_memory``: torch_dist checkpoint saving logs each writer's memory through
   ``psutil``, and fails without it; where psutil is missing the resident size is read from
   ``/proc/self/statm`` (Linux) instead. It is only logged.
8. ``optimizer_steps``: without Apex or TE's fused optimizers (hidden on a CPU), the
   distributed optimizer keeps torch Adam's per-parameter ``step``, and megatron-core 0.19.2
   mishandles it twice when a checkpoint is loaded. Its ``state_dict`` reads the step from that
   state and asserts that there is exactly one (``distrib_optimizer.py:839``); loading calls it
   before the first step, to allocate the state it then loads into
   (``sharded_state_dict(is_loading=True)``), when there is no state and so no step: resuming
   fails. With no state it reads step 0, which is true then. Loading then sets every
   parameter's step to the checkpoint's (its ``param_groups``), as one tensor shared by all
   (``:1026-1032``), and ``load_parameter_state_from_dp_reshardable`` copies over it the step
   of the state allocated before the load (``:1225``): the per-parameter step is not in the
   checkpoint (a ``LocalNonpersistentObject``, "handled separately via param_groups", ``:1951``).
   So a resumed run's Adam restarts its bias corrections from step 0 (and, on one shared tensor,
   counts each step once per parameter): an update of the wrong size, small only while the
   warm-up keeps the learning rate small. After loading, each parameter's step is the
   checkpoint's, in a tensor of its own, as torch's Adam keeps it.
9. ``fp32_optimizer_load``: a megatron-core bug that the float32 runs meet. The distributed
   optimizer's float32 main parameters are views of the model's parameters, which require
   grad (``distrib_optimizer.py:467``), and loading its ``dp_reshardable`` state (the default
   format) copies into them in place (``:1225``) with autograd on, which torch refuses ("a view
   of a leaf Variable that requires grad is being used in an in-place operation"): its
   sibling loaders (``fs_model_space``, ``fully_reshardable``) run under ``torch.no_grad()``,
   ``load_parameter_state_from_dp_reshardable`` (``:2061``) does not. A bf16 or fp16 job's main
   parameters are copies, so only float32 training, which the CPU runs are (``--bf16``
   dropped), cannot resume; the loader runs under ``torch.no_grad()``, as its siblings do.

:func:`apply_training_patches` applies them and the model-level ones; it is the one switch of
the CPU layer: the GPU path never calls it (:func:`cpu_layer_active` says whether it ran).
"""

from __future__ import annotations

import os
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

from shardcheck.patching import patched

_applied: list[str] = []


def _identity(func: Callable[..., Any]) -> Callable[..., Any]:
    return func


def patch_typing_override() -> None:
    """``typing.override`` on Python 3.11 (the identity, as 3.12's is at run time)."""
    if not hasattr(typing, "override"):
        typing.override = _identity  # type: ignore[attr-defined]
        _applied.append("typing_override")


def _allowing_no_cuda(initialize: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize(*args, **kwargs)

    return initialize_megatron


def _patch_allow_no_cuda() -> None:
    from megatron.training import training

    training.initialize_megatron = _allowing_no_cuda(training.initialize_megatron)


def _patch_device_count() -> None:
    import torch

    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *_args, **_kwargs: None


FSDP_FLAGS = ("--use-torch-fsdp2", "--use-megatron-fsdp")


def _patch_device_arch() -> None:
    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 9
    if any(flag in sys.argv for flag in FSDP_FLAGS):
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # what Megatron asserts for FSDP
    else:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"


def _patch_nccl_options() -> None:
    from megatron.core import parallel_state

    parallel_state.get_nccl_options = lambda *_args, **_kwargs: None


class _CpuDeviceMesh:
    """torch's ``DeviceMesh`` as Megatron's FSDP2 wrapper uses it, on the CPU's device type."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed import DeviceMesh

        return DeviceMesh.from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _patch_fsdp_mesh() -> None:
    from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp

    if hasattr(fsdp, "DeviceMesh"):
        fsdp.DeviceMesh = _CpuDeviceMesh


def _patch_dataset_helpers() -> None:
    from megatron.core.datasets import (
        helpers_cpp,  # noqa: F401 - fails loudly if not prebuilt
        utils,
    )

    utils.compile_helpers = lambda: None


def _patch_eager_fusions() -> None:
    import torch._dynamo

    torch._dynamo.config.disable = True
    from megatron.training import initialize

    initialize._warmup_jit_function = lambda *_args, **_kwargs: None


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _patch_process_memory() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = _resident_bytes


def _stepless_state_dict(state_dict: Callable[[Any], Any]) -> Callable[[Any], Any]:
    from megatron.core.optimizer import distrib_optimizer

    def stepless(self: Any) -> Any:
        inner = self.optimizer
        if distrib_optimizer.HAVE_APEX_OR_TE or getattr(inner, "state", True):
            return state_dict(self)
        import torch

        # the state, which state_dict leaves out, seen as one entry at step 0
        at_zero = {**inner.state_dict(), "state": {0: {"step": torch.tensor(0.0)}}}
        with patched(inner, "state_dict", lambda: at_zero):
            return state_dict(self)

    return stepless


def _own_steps(load_state_dict: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    from megatron.core.optimizer import distrib_optimizer

    def load(self: Any, state_dict: Any) -> Any:
        loaded = load_state_dict(self, state_dict)
        groups = state_dict.get("optimizer", {}).get("param_groups", [])
        steps = {group["step"] for group in groups if "step" in group}
        if distrib_optimizer.HAVE_APEX_OR_TE or len(steps) != 1:
            return loaded
        import torch

        (step,) = steps
        for state in self.optimizer.state.values():
            if "step" in state:  # the checkpoint's step, a tensor of its own as torch's Adam keeps it
                state["step"] = torch.tensor(float(step))
        return loaded

    return load


def _patch_optimizer_steps() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    DistributedOptimizer.state_dict = _stepless_state_dict(DistributedOptimizer.state_dict)
    DistributedOptimizer.load_state_dict = _own_steps(DistributedOptimizer.load_state_dict)


def _patch_fp32_optimizer_load() -> None:
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    load = DistributedOptimizer.load_parameter_state_from_dp_reshardable
    DistributedOptimizer.load_parameter_state_from_dp_reshardable = torch.no_grad()(load)


def apply_training_patches() -> None:
    """Make ``megatron.training.pretrain`` run on this process's CPU; a second call does nothing."""
    if "cpu" in _applied:
        return
    patch_typing_override()
    from shardcheck.megatron.cpu.patches import apply_cpu_patches

    apply_cpu_patches()
    for name, patch in (("allow_no_cuda", _patch_allow_no_cuda), ("device_count", _patch_device_count),
                        ("device_arch", _patch_device_arch), ("nccl_options", _patch_nccl_options),
                        ("fsdp_mesh", _patch_fsdp_mesh),
                        ("dataset_helpers", _patch_dataset_helpers),
                        ("eager_fusions", _patch_eager_fusions), ("process_memory", _patch_process_memory),
                        ("optimizer_steps", _patch_optimizer_steps),
                        ("fp32_optimizer_load", _patch_fp32_optimizer_load)):
        patch()
        _applied.append(name)
    _applied.append("cpu")


def install_transformer_engine(argv: Sequence[str]) -> bool:
    """Install Transformer Engine's CPU layer when the rank's Megatron flags ``argv`` ask for
    ``--transformer-impl transformer_engine`` (before megatron-core is imported: it probes for
    TE as its modules load), TE's fused optimizers hidden (Megatron's torch fallbacks run, as
    without TE). A rank forked from a server that preloaded it finds it installed."""
    from shardcheck.megatron.cpu import asks_for_transformer_engine

    if not asks_for_transformer_engine(argv):
        return False
    from shardcheck.megatron.cpu.te import install_for_training

    install_for_training()
    _applied.append("transformer_engine")
    return True


def cpu_layer_active() -> bool:
    """Whether :func:`apply_training_patches` ran in this process."""
    return "cpu" in _applied


def applied_patches() -> list[str]:
    """The names of the training patches applied in this process, in order."""
    return list(_applied)
