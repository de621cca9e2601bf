"""Transformer Engine's own PyTorch code on a CPU: its Python as released, our CPU extension.

``install()`` makes ``import transformer_engine.pytorch`` work without CUDA: it puts the pinned
``transformer-engine`` wheel (installed by the Makefile into ``.venv/transformer-engine-VERSION``,
outside site-packages so that megatron-core's import-time ``HAVE_TE`` probes elsewhere stay
false) on ``sys.path``, imports TE's package with its CUDA library loading skipped, and registers
:mod:`shardcheck.megatron.cpu.te.extension` as ``transformer_engine_torch``. Nothing here runs at
``import shardcheck``. ``installed()`` does the same for a ``with`` block and then takes TE off
``sys.path`` and ``sys.modules`` again (and restores torch's device queries), so that
megatron-core modules imported later in the process still see no Transformer Engine.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from shardcheck.megatron.cpu.patches import _in_device_mode
from shardcheck.patching import patched, patched_attrs

TE_VERSION = "2.20.2"
# The device TE is told it runs on: an Ampere-class GPU (sm_80) has bf16 and no FP8, so TE's own
# checks refuse FP8 recipes; one "SM" for the few sizes TE derives from the SM count.
DEVICE = SimpleNamespace(name="cpu (shardcheck)", major=8, minor=0, multi_processor_count=1,
                         total_memory=0)
TE_DIR_ENV = "SHARDCHECK_TE_DIR"


class TransformerEngineMissing(ImportError):
    """The pinned transformer-engine wheel is not where ``install()`` looks."""


class QuantisationRefused(NotImplementedError):
    """An FP8/FP4 recipe: the CPU extension computes in fp32, bf16 and fp16 only."""


def te_dir() -> Path:
    """Where the pinned wheel is installed: ``$SHARDCHECK_TE_DIR`` or ``<venv>/transformer-engine-VERSION``."""
    return Path(os.environ.get(TE_DIR_ENV) or Path(sys.prefix) / f"transformer-engine-{TE_VERSION}")


def _cpu_extension(framework: str) -> None:
    """TE's ``load_framework_extension``: the CPU module instead of the compiled one."""
    from shardcheck.megatron.cpu.te import extension

    sys.modules[f"transformer_engine_{framework}"] = extension


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _device_capability(*_args: Any, **_kwargs: Any) -> tuple[int, int]:
    return DEVICE.major, DEVICE.minor


_IS_CUDA = torch._C.TensorBase.__dict__["is_cuda"]


class ReportsCuda(TorchFunctionMode):
    """``tensor.is_cuda`` answers yes: TE's input checks refuse CPU tensors, nothing else."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _IS_CUDA:
            return True
        return func(*args, **(kwargs or {}))


def _reporting_cuda(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        with ReportsCuda():
            return method(*args, **kwargs)

    return checked


def _with_cuda_available(init: Callable[..., None]) -> Callable[..., None]:
    """TE's base module constructor, run while ``torch.cuda.is_available()`` says yes."""

    @functools.wraps(init)
    def build(self: Any, *args: Any, **kwargs: Any) -> None:
        with patched(torch.cuda, "is_available", lambda: True):
            init(self, *args, **kwargs)

    return build


def _te_modules() -> list[tuple[str, ModuleType]]:
    return [(name, module) for name, module in list(sys.modules.items())
            if name.startswith("transformer_engine.") and module is not None]


def _rebind(original: Any, replacement: Any) -> None:
    """``replacement`` wherever a loaded TE module holds ``original`` under any name."""
    for _, module in _te_modules():
        for name, value in list(vars(module).items()):
            if value is original:
                setattr(module, name, replacement)


def _canonical_device(device: torch.device | str | None) -> torch.device:
    """TE's ``canonicalize_device``: its default (and any CUDA) device is the CPU."""
    device = torch.device("cpu") if device is None else torch.device(device)
    return torch.device("cpu") if device.type == "cuda" else device


_GLOBAL_QUERIES = ("get_device_capability", "is_current_stream_capturing")


def _patch_device_queries(te_pytorch: ModuleType) -> None:
    """TE's device queries: the capability and properties of :data:`DEVICE`.

    On a CPU-only torch these calls raise; code that asks ``is_available()`` first still hears
    no, except TE's module constructor, which refuses to build without CUDA.
    """
    torch.cuda.get_device_capability = _device_capability
    torch.cuda.is_current_stream_capturing = lambda: False
    te_utils = sys.modules["transformer_engine.pytorch.utils"]
    te_utils._get_device_compute_capability = _device_capability
    te_gemm = sys.modules["transformer_engine.pytorch.cpp_extensions.gemm"]
    te_gemm.get_sm_count = te_utils.get_sm_count = lambda: DEVICE.multi_processor_count
    te_gemm.get_cublas_workspace_size_bytes = lambda: 0
    _rebind(te_utils.canonicalize_device, _canonical_device)
    base = te_pytorch.module.base.TransformerEngineBaseModule
    base.__init__ = _with_cuda_available(base.__init__)
    base.prepare_forward = _reporting_cuda(base.prepare_forward)
    attention = te_pytorch.DotProductAttention
    attention.forward = _reporting_cuda(attention.forward)


def _backwards_in_device_mode() -> None:
    """Every TE autograd function's backward runs under the CUDA-to-CPU device mode.

    The mode is off while it handles ``Tensor.backward``, so ``.cuda()`` and ``device="cuda"``
    in TE's backward code (its empty-tensor placeholder, gradient buffers) would reach CUDA.
    """
    for name, module in _te_modules():
        for cls in vars(module).values():
            if (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)
                    and cls.__module__ == name and "backward" in cls.__dict__):
                backward = cls.__dict__["backward"]
                if isinstance(backward, staticmethod):
                    cls.backward = staticmethod(_in_device_mode(backward.__func__))


class WaitOnce:
    """A point-to-point request whose ``wait()`` may be called again once it has completed.

    TE's context-parallel ring waits on each key/value exchange twice in its backward (inside a
    step and again before the next one). NCCL's work objects allow that; Gloo's block on the
    second ``wait()`` until the process group's timeout, waiting for a second completion.
    """

    def __init__(self, request: Any) -> None:
        self.request = request
        self.done = False

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        """The request's own ``wait()`` the first time; afterwards it has completed."""
        if not self.done:
            self.request.wait(*args, **kwargs)
            self.done = True
        return True


def _waiting_once(communicate: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """TE's ``flash_attn_p2p_communicate``, its requests wrapped in :class:`WaitOnce`."""

    @functools.wraps(communicate)
    def exchange(*args: Any, **kwargs: Any) -> list[Any]:
        return [WaitOnce(request) for request in communicate(*args, **kwargs)]

    return exchange


def _patch_context_parallel_ring() -> None:
    """TE's context-parallel ring on Gloo: its exchanges' requests may be waited on twice."""
    from transformer_engine.pytorch.attention.dot_product_attention import context_parallel

    context_parallel.flash_attn_p2p_communicate = _waiting_once(context_parallel.flash_attn_p2p_communicate)


def refuse_recipe(recipe: Any = None) -> None:
    """TE's recipe support check: every FP8/FP4 recipe is refused in one line."""
    name = type(recipe).__name__ if recipe is not None else "default FP8"
    raise QuantisationRefused(
        f"Transformer Engine {name} recipe refused: shardcheck's CPU kernels run fp32, bf16 "
        "and fp16 only (no FP8/FP4)"
    )


def _refusing_quantisation(enter: Callable[..., None]) -> Callable[..., None]:
    """TE's autocast entry, refusing an enabled (or calibrating) quantisation recipe."""

    @functools.wraps(enter)
    def checked(cls: Any, enabled: bool = False, calibrating: bool = False,
                fp8_recipe: Any = None, *args: Any, **kwargs: Any) -> None:
        if enabled or calibrating:
            refuse_recipe(fp8_recipe)
        enter(cls, enabled, calibrating, fp8_recipe, *args, **kwargs)

    return checked


def _accept_recipe(_recipe: Any = None) -> None:
    """TE's recipe support check under :func:`unquantised`: every recipe is taken (none quantises)."""


def _entering_unquantised(enter: Callable[..., None]) -> Callable[..., None]:
    """TE's autocast entry with quantisation (and calibration) off: the recipe, the amax group and
    the nesting depth are recorded as TE records them, and TE's modules compute unquantised."""

    @functools.wraps(enter)
    def unquantised_entry(cls: Any, enabled: bool = False, calibrating: bool = False,
                          fp8_recipe: Any = None, *args: Any, **kwargs: Any) -> None:
        enter(cls, False, False, fp8_recipe, *args, **kwargs)

    return unquantised_entry


@contextmanager
def unquantised() -> Iterator[None]:
    """For the block, TE's FP8/FP4 autocast regions are entered without quantising.

    megatron-core's FP8/FP4 paths (``config.fp8``, ``config.fp4``) then run as written: its
    ``get_fp8_context``/``get_fp4_context`` build their recipes and enter TE's ``autocast``, and
    the code that branches on those options (``te_checkpoint`` for recomputation) runs; only
    the quantisation, which these CPU kernels lack, is left out. TE's modules see FP8 off
    (``FP8GlobalStateManager.is_fp8_enabled()``) and compute in the model's precision, the same
    on one rank and on many. Outside the block (and in ``shardcheck train``) recipes are refused.
    Nothing happens where TE is not loaded.
    """
    te_pytorch = sys.modules.get("transformer_engine.pytorch")
    if te_pytorch is None:
        yield
        return
    quantization = te_pytorch.quantization
    manager = quantization.FP8GlobalStateManager
    refusing = manager.__dict__["autocast_enter"].__func__
    with patched_attrs([(quantization, "check_recipe_support", _accept_recipe),
                        (manager, "autocast_enter",
                         classmethod(_entering_unquantised(refusing.__wrapped__)))]):
        yield


def _patch_rng() -> None:
    """TE's CUDA RNG state (its checkpoint saves and restores it): the CPU generator's, which
    CPU ops draw from (as megatron-core's ``rng`` patch does for its tracker)."""
    distributed = sys.modules["transformer_engine.pytorch.distributed"]
    _rebind(distributed._get_cuda_rng_state, lambda *_args, **_kwargs: torch.get_rng_state())
    _rebind(distributed._set_cuda_rng_state, lambda state, *_args, **_kwargs: torch.set_rng_state(state))


def install() -> ModuleType:
    """Import ``transformer_engine.pytorch`` on its CPU extension (idempotent); returns it."""
    if "transformer_engine.pytorch" in sys.modules:
        return sys.modules["transformer_engine.pytorch"]
    root = te_dir()
    if not (root / "transformer_engine").is_dir():
        raise TransformerEngineMissing(
            f"transformer-engine {TE_VERSION} is not installed in {root} (make installs it)"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    # TE's package __init__ loads cuDNN, NVRTC, cuRAND and its core library unless it is being
    # built; its framework import then fails softly (a warning) on the missing .so. Its fused
    # helpers (jit_fuser) would be torch.compile-d: on a CPU that compiles C++ for seconds in
    # every rank process; NVTE_TORCH_COMPILE=0 makes them the plain functions.
    with _environment(NVTE_PROJECT_BUILDING="1", NVTE_TORCH_COMPILE="0"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        import transformer_engine.common as common
    common.load_framework_extension = _cpu_extension
    with _environment(NVTE_TORCH_COMPILE="0"):
        import transformer_engine.pytorch as te_pytorch

    _patch_device_queries(te_pytorch)
    _backwards_in_device_mode()
    _patch_context_parallel_ring()
    _patch_rng()
    te_pytorch.quantization.check_recipe_support = refuse_recipe
    manager = te_pytorch.quantization.FP8GlobalStateManager
    manager.autocast_enter = classmethod(_refusing_quantisation(manager.__dict__["autocast_enter"].__func__))
    return te_pytorch


# Every process-wide cache of tensors in TE's Python, as (module, name): a dict, or a function
# under functools.lru_cache. Each holds values derived from its key alone (causal masks,
# cumulative sequence lengths, context-parallel chunk orders, dummy weight gradients, ones).
CACHED_TENSORS = (
    ("transformer_engine.pytorch.attention.dot_product_attention.softmax", "_default_causal_mask"),
    ("transformer_engine.pytorch.attention.dot_product_attention.utils", "_cu_seqlens_cache"),
    ("transformer_engine.pytorch.attention.dot_product_attention.context_parallel", "_cu_seqlens_info_with_cp_cache"),
    ("transformer_engine.pytorch.attention.dot_product_attention.context_parallel",
     "_seq_chunk_ids_cache_for_reordering_before_attn"),
    ("transformer_engine.pytorch.attention.dot_product_attention.context_parallel",
     "_seq_chunk_ids_cache_for_reordering_after_attn"),
    ("transformer_engine.pytorch.attention.dot_product_attention.context_parallel", "_softmax_offset_chunk_ids_cache"),
    ("transformer_engine.pytorch.module.base", "_dummy_wgrads"),
    ("transformer_engine.pytorch.utils", "get_cached_ones_tensor"),
    ("transformer_engine.pytorch.utils", "_empty_tensor"),
)


def forget_cached_tensors() -> None:
    """Empty TE's process-wide tensor caches (:data:`CACHED_TENSORS`) where TE is loaded.

    A warm rank process runs scenario after scenario. A tensor TE cached in one scenario's
    type-checked region has that region's types only: in the next region, on another mesh, it
    is a tensor made outside the region, of unknown type, and so is all computed from it (the
    causal mask, so every attention score and all that follows). Emptied before each scenario,
    the caches are filled in its own region, as when it is the process's first.
    """
    for module_name, name in CACHED_TENSORS:
        cache = getattr(sys.modules.get(module_name), name, None)
        if isinstance(cache, dict):
            cache.clear()
        elif cache is not None:
            cache.cache_clear()


FUSED_OPTIMIZERS = "transformer_engine.pytorch.optimizers"


def install_for_training() -> ModuleType:
    """``install()``, with TE's fused optimizers hidden from megatron-core.

    ``transformer_engine.pytorch.optimizers`` (``FusedAdam``, ``FusedSGD``, the multi-tensor
    L2 norm and scale) are CUDA kernels with no CPU implementation here. megatron-core imports
    them when its optimizer modules load and falls back to torch's optimizers and its own
    multi-tensor functions when the import fails, as it does without TE; this makes it fail.
    """
    te_pytorch = install()
    sys.modules[FUSED_OPTIMIZERS] = None  # type: ignore[assignment] - `from ... import` raises ImportError
    return te_pytorch


@contextmanager
def installed() -> Iterator[ModuleType]:
    """``install()`` for a block; afterwards TE is neither importable nor imported."""
    if "transformer_engine.pytorch" in sys.modules:
        yield sys.modules["transformer_engine.pytorch"]
        return
    path = list(sys.path)
    try:  # install() answers torch.cuda's device queries: they are put back afterwards
        with patched_attrs((torch.cuda, name, getattr(torch.cuda, name)) for name in _GLOBAL_QUERIES):
            yield install()
    finally:
        sys.path[:] = path
        for name in [n for n in sys.modules if n.split(".")[0] in ("transformer_engine", "transformer_engine_torch")]:
            del sys.modules[name]
