"""Run megatron-core on a CPU: the few patches it needs, applied once per rank.

megatron-core assumes CUDA in a handful of places that have nothing to do with the numbers it
computes. Each patch below replaces one such place with its CPU equivalent and nothing else:

1. ``rng``: Megatron's CUDA RNG tracker (``_get_cuda_rng_state``/``_set_cuda_rng_state``) and
   ``torch.cuda.get_rng_state``/``set_rng_state``/``manual_seed`` act on the CPU generator, so the
   tracker forks and restores the generator CPU ops actually draw from.
2. ``current_device``: ``torch.cuda.current_device()`` returns ``"cpu"``, the device Megatron's
   buffers are then allocated on.
3. ``torch_norm_sp``: ``WrappedTorchNorm`` refuses ``sequence_parallel``. It is built from a copy
   of the config with sequence parallelism off, then its parameters are marked
   ``sequence_parallel=True``, as Megatron's own fused norms do, so their gradients are
   all-reduced over tensor parallelism by ``finalize_model_grads``.
4. ``device_mode``: a small TorchFunctionMode rewrites ``device="cuda"``, ``.cuda()``,
   ``.to("cuda")`` and ``pin_memory`` to CPU, for the hard-coded ones; ``tensor.type()`` with
   no argument reports the CUDA type name (``torch.cuda.FloatTensor``), which gradient clipping
   asserts.
   ``recompute``: the mode is off while it handles a call, so through all of ``backward``; the
   checkpoint functions of ``tensor_parallel.random`` (recomputation) rerun forward code there,
   and their ``backward`` runs under the mode again.
5. ``synchronize``: ``torch.cuda.synchronize()`` (and stream waits) are no-ops: CPU ops are
   synchronous. Pipeline send/recv calls it.
6. ``streams``: ``torch.cuda.current_stream()``/``default_stream()``/``Stream()`` and the
   ``torch.cuda.stream(...)`` context and ``torch.cuda.Event()`` return do-nothing CPU stand-ins, for the DDP, optimizer
   and MoE (alltoall dispatcher, shared experts) code that only creates, records or waits on
   side streams.

7. ``te_gemm_name``: ``moe_utils.te_general_gemm`` is only defined when Transformer Engine imports,
   yet the router's gating linear tests it for ``None``; without TE it is set to ``None``, which
   selects Megatron's own torch matmul path.

8. ``host_copy``: the MoE alltoall dispatcher gets its split sizes from
   ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA tensors; a CPU
   tensor is converted to numpy too, as the GPU path would return it.

9. ``uneven_collectives``: the MoE alltoall dispatcher under tp > 1 gathers (and reduce-scatters)
   pieces of different sizes with the list forms of ``all_gather`` and ``reduce_scatter``,
   which NCCL accepts and Gloo refuses. Uneven pieces are padded to the largest, exchanged,
   and cut back (unseen by the type checker, which types the exchange as the uneven
   collective); even pieces go straight to torch.

10. ``llava_te_attention``: ``LLaVAModel`` accepts sequence parallelism only when the language
    model's core attention is Transformer Engine's ``TEDotProductAttention``; without Transformer
    Engine that name is undefined in ``llava_model`` and the check cannot pass. There it names
    megatron-core's torch ``DotProductAttention`` (the local spec's) and ``HAVE_TE`` is set,
    which ``llava_model`` reads only in that check and in its context-parallel path (refused).

11. ``clip_norm``: without Transformer Engine, ``CLIPViTModel``'s default ``ln_pre``/``ln_post``
    is ``torch.nn.LayerNorm``, which cannot take the ``config`` Megatron builds it with; the
    defaults become megatron-core's ``WrappedTorchNorm`` (the same LayerNorm, built from the
    config), the CPU stand-in for ``TENorm``. Explicitly passed norms are left alone.
12. ``gdn_kernels``: Gated DeltaNet imports its kernels from CUDA-only packages (``fla``,
    ``causal_conv1d``) and refuses to build without them. In the modules its code reads (a
    single module in 0.16, ``gated_delta_net/common.py`` in 0.19), each kernel that failed to
    import becomes its plain-torch equivalent from :mod:`shardcheck.megatron.cpu.kernels`, in the
    calling convention of the name (``causal_conv1d_fn`` or FLA's ``causal_conv1d``), and
    ``HAVE_FLA`` is set. Its methods wrapped in ``torch.compile`` (Megatron's ``jit_fuser``),
    which on a CPU compile C++ for seconds in every new rank process, run as plain functions.
13. ``mamba_kernels``: the same for the Mamba mixer (``mamba_ssm``, ``causal_conv1d``); its
    ``ExtendedRMSNorm`` (a MagicMock subclass without ``mamba_ssm``) becomes the plain gated
    RMSNorm with Megatron's own ``sharded_state_dict``. ``mamba_mixer`` also imports Triton
    inference helpers at module level: when Triton is missing, a stand-in module whose
    functions refuse to run (they are only used for inference) lets it import. Needs
    ``einops``.
14. ``compiled_functions``: every other function and method Megatron's ``jit_fuser`` wrapped
    in ``torch.compile`` (the L2 norm of ``qk_l2_norm``, the fused cross-entropy, bias-GeLU,
    ...): its first call compiled C++ for 15-20 s in every rank process, long enough for a
    case to read as hung. The loaded ones run as the functions they wrap, and modules loaded
    after get Megatron's own no-op ``jit_fuser``. Under the type checker they ran uncompiled
    already (Dynamo compiles nothing while a dispatch mode is on the stack).

Each patch finds its target by what the code does, not by where one release kept it: a kernel
is set in the module whose globals the layer's code reads, a replaced function in every loaded
megatron-core module that holds it, a compiled method is recognised by its compiled wrapper. A
patch whose target this megatron-core does not have is not applied, and
:func:`patch_status` says so ("not needed for this version: ..."), never an error.

``apply_cpu_patches()`` applies all of them (idempotent) and ``remove_cpu_patches()`` restores
every original.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from shardcheck.patching import Patches

_CPU = torch.device("cpu")
_patches = Patches()
_mode: TorchFunctionMode | None = None
_MISSING = object()
APPLIED = "applied"
NOT_NEEDED = "not needed for this version"
_status: dict[str, str] = {}


class NotNeeded(Exception):
    """The patch's target is absent from this megatron-core: there is nothing to patch."""


def _module(name: str) -> Any:
    """The megatron-core module ``name``; NotNeeded when this version has none."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name) and exc.name.startswith("megatron"):
            raise NotNeeded(f"{name} is not in this megatron-core") from None
        raise


def _attribute(owner: Any, name: str) -> Any:
    """``owner.name``; NotNeeded when this version does not define it."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise NotNeeded(f"{getattr(owner, '__name__', owner)}.{name} is not in this megatron-core") from None


def _holders(original: Any) -> list[Any]:
    """Every loaded megatron-core module whose namespace holds ``original`` (its home and the
    modules that imported it by name)."""
    return [module for name, module in list(sys.modules.items())
            if name.startswith("megatron.core") and module is not None
            and any(value is original for value in list(vars(module).values()))]


def _rebind(original: Any, replacement: Any) -> None:
    """Replace ``original`` wherever megatron-core holds it by name."""
    for module in _holders(original):
        for name, value in list(vars(module).items()):
            if value is original:
                _set(module, name, replacement)


def _globals_read(cls: type) -> dict[Any, set[str]]:
    """The global names the methods of ``cls`` and its megatron bases read, by the module
    whose namespace they are read from."""
    found: dict[Any, set[str]] = {}
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is None or not klass.__module__.startswith("megatron.core"):
            continue
        for value in vars(klass).values():
            function = inspect.unwrap(getattr(value, "_torchdynamo_orig_callable", value))
            code = getattr(function, "__code__", None)
            if code is not None:
                found.setdefault(module, set()).update(code.co_names)
    return found


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Send every tensor that code asks to put on CUDA to the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.is_pinned:
            return False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _CpuEvent:
    """What Megatron needs of a CUDA event on a CPU: it has always happened."""

    def record(self, _stream: Any = None) -> None:
        """Nothing to record."""

    def synchronize(self) -> None:
        """CPU ops are synchronous."""

    def wait(self, _stream: Any = None) -> None:
        """CPU ops are synchronous."""

    def query(self) -> bool:
        return True


class _CpuStream:
    """What Megatron needs of a CUDA stream on a CPU: nothing to wait for."""

    def wait_stream(self, _other: Any) -> None:
        """CPU ops are synchronous."""

    def wait_event(self, _event: Any) -> None:
        """CPU ops are synchronous."""

    def synchronize(self) -> None:
        """CPU ops are synchronous."""

    def record_event(self, event: Any = None) -> Any:
        """An event that has already happened."""
        return event if event is not None else _CpuEvent()

    def __enter__(self) -> _CpuStream:
        return self

    def __exit__(self, *_exc: Any) -> None:
        return None


def _set(owner: Any, name: str, value: Any) -> None:
    _patches.set(owner, name, value)


def _cpu_get_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(seed)


def _patch_rng() -> None:
    mrandom = _module("megatron.core.tensor_parallel.random")
    _set(torch.cuda, "get_rng_state", _cpu_get_rng_state)
    _set(torch.cuda, "set_rng_state", _cpu_set_rng_state)
    _set(torch.cuda, "manual_seed", _cpu_manual_seed)
    for name, cpu_version in (("_get_cuda_rng_state", _cpu_get_rng_state),
                              ("_set_cuda_rng_state", _cpu_set_rng_state)):
        if hasattr(mrandom, name):
            _rebind(getattr(mrandom, name), cpu_version)


def _in_device_mode(backward: Callable[..., Any]) -> Callable[..., Any]:
    def rerun(ctx, *grads):
        with CudaToCpuMode():
            return backward(ctx, *grads)

    return rerun


def _patch_recompute() -> None:
    mrandom = _module("megatron.core.tensor_parallel.random")
    checkpoints = [cls for cls in vars(mrandom).values() if isinstance(cls, type)
                   and issubclass(cls, torch.autograd.Function) and cls.__module__ == mrandom.__name__]
    if not checkpoints:
        raise NotNeeded("tensor_parallel.random defines no checkpoint function")
    for cls in checkpoints:
        _set(cls, "backward", staticmethod(_in_device_mode(cls.__dict__["backward"].__func__)))


def _patch_current_device() -> None:
    _set(torch.cuda, "current_device", lambda: "cpu")


def _norm_with_sequence_parallel(original_new: Callable[..., Any]) -> Callable[..., Any]:
    def build(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return build


def _patch_torch_norm() -> None:
    WrappedTorchNorm = _attribute(_module("megatron.core.transformer.torch_norm"), "WrappedTorchNorm")  # noqa: N806
    _set(WrappedTorchNorm, "__new__", _norm_with_sequence_parallel(WrappedTorchNorm.__new__))


def _patch_synchronize() -> None:
    _set(torch.cuda, "synchronize", lambda *_a, **_k: None)


def _patch_streams() -> None:
    stream = _CpuStream()
    _set(torch.cuda, "current_stream", lambda *_a, **_k: stream)
    _set(torch.cuda, "default_stream", lambda *_a, **_k: stream)
    _set(torch.cuda, "Stream", lambda *_a, **_k: _CpuStream())
    _set(torch.cuda, "stream", lambda *_a, **_k: _CpuStream())
    _set(torch.cuda, "Event", lambda *_a, **_k: _CpuEvent())


def _patch_te_gemm_name() -> None:
    moe_utils = _module("megatron.core.transformer.moe.moe_utils")
    if hasattr(moe_utils, "te_general_gemm"):
        raise NotNeeded("moe_utils.te_general_gemm is defined without Transformer Engine")
    _set(moe_utils, "te_general_gemm", None)


def _to_host(original: Callable[..., Any]) -> Callable[..., Any]:
    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move


def _patch_host_copy() -> None:
    moe_utils = _module("megatron.core.transformer.moe.moe_utils")
    _module("megatron.core.transformer.moe.token_dispatcher")
    original = _attribute(moe_utils, "maybe_move_tensor_to_cpu")
    _rebind(original, _to_host(original))


def _uneven(tensors: list[torch.Tensor]) -> bool:
    return len({t.shape for t in tensors}) > 1


@contextmanager
def _unseen() -> Iterator[Any]:
    """Run the padding and cutting unseen by an active type checker (which is yielded, or None),
    so that it types the exchange as the uneven collective itself."""
    from shardcheck.typecheck.checker import current

    checker = current()
    with checker.paused() if checker else nullcontext():
        yield checker


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    with _unseen() as checker:
        padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, padding]) if padding.numel() else tensor.contiguous().clone()
        if checker:
            checker.set_type(padded, checker.types(tensor))
    return padded


def _cut_into(out: torch.Tensor, exchanged: torch.Tensor) -> None:
    with _unseen() as checker:
        out.copy_(exchanged[:out.shape[0]])
        if checker:
            checker.update_inplace(out, checker.types(exchanged))


def _gloo_all_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not _uneven(tensor_list):
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        gathered = [tensor.new_empty((rows, *tensor.shape[1:])) for _ in tensor_list]
        original(gathered, _padded(tensor, rows), group=group)
        for out, piece in zip(tensor_list, gathered, strict=True):
            _cut_into(out, piece)
        return None

    return all_gather


def _gloo_reduce_scatter(original: Callable[..., Any]) -> Callable[..., Any]:
    def reduce_scatter(output, input_list, op=torch.distributed.ReduceOp.SUM, group=None,
                       async_op=False):
        if not _uneven(input_list):
            return original(output, input_list, op=op, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in input_list)
        reduced = output.new_empty((rows, *output.shape[1:]))
        original(reduced, [_padded(t, rows) for t in input_list], op=op, group=group)
        _cut_into(output, reduced)
        return None

    return reduce_scatter


def _patch_uneven_collectives() -> None:
    import torch.distributed as dist

    _set(dist, "all_gather", _gloo_all_gather(dist.all_gather))
    _set(dist, "reduce_scatter", _gloo_reduce_scatter(dist.reduce_scatter))


def _patch_llava_te_attention() -> None:
    llava_model = _module("megatron.core.models.multimodal.llava_model")
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if _attribute(llava_model, "HAVE_TE"):
        raise NotNeeded("Transformer Engine is installed")
    _set(llava_model, "TEDotProductAttention", DotProductAttention)
    _set(llava_model, "HAVE_TE", True)


def _with_default_norms(original_init: Callable[..., Any], norm: type) -> Callable[..., Any]:
    def init(self, *args, **kwargs):
        if len(args) <= 2:  # the norms were not passed positionally
            kwargs.setdefault("ln_pre_impl", norm)
            kwargs.setdefault("ln_post_impl", norm)
        original_init(self, *args, **kwargs)

    return init


def _patch_clip_norm() -> None:
    clip_vit_model = _module("megatron.core.models.vision.clip_vit_model")
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(clip_vit_model, "NORM_IMPL", None) is not torch.nn.LayerNorm:
        raise NotNeeded("CLIPViTModel's default norm takes a config")
    model = clip_vit_model.CLIPViTModel
    _set(model, "__init__", _with_default_norms(model.__init__, WrappedTorchNorm))


def _set_missing(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name`` to ``value`` where the import that defines it failed (None or unset)."""
    current = getattr(owner, name, _MISSING)
    if current is None or current is _MISSING:
        _set(owner, name, value)


_TRITON_TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


def _inference_only(name: str) -> Callable[..., Any]:
    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise NotImplementedError(f"{name} is a Triton kernel for inference; not on a CPU")
    return refuse


def _stub_triton_tensor_ops() -> None:
    """Let ``mamba_mixer`` import without Triton (its tensor_ops serve inference only)."""
    import importlib
    import sys
    import types

    try:
        importlib.import_module(_TRITON_TENSOR_OPS)
    except ImportError:
        stub = types.ModuleType(_TRITON_TENSOR_OPS)
        for name in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
            setattr(stub, name, _inference_only(name))
        sys.modules[_TRITON_TENSOR_OPS] = stub


def _gated_norm_class(mock: Any, kernels: Any) -> type:
    """``ExtendedRMSNorm`` on the plain gated norm, keeping Megatron's ``sharded_state_dict``.

    Without ``mamba_ssm`` its base is a MagicMock, so the class statement called
    ``MagicMock(name, bases, body)``: the body is the mock's ``return_value``.
    """
    body = mock.return_value
    if not isinstance(body, dict) or "sharded_state_dict" not in body:
        raise RuntimeError("unexpected mamba_mixer.ExtendedRMSNorm: cannot rebuild it")
    return type("ExtendedRMSNorm", (kernels.RMSNormGated,),
                {"sharded_state_dict": body["sharded_state_dict"], "__doc__": body.get("__doc__")})


def _compiled_original(value: Any) -> Any:
    """The plain function a ``torch.compile``-d function wraps, or None (read from a function's
    own namespace: a MagicMock stand-in has every attribute)."""
    if not isinstance(value, types.FunctionType):
        return None
    return vars(value).get("_torchdynamo_orig_callable")


def _eager_methods(cls: type) -> None:
    """Run the methods Megatron's ``jit_fuser`` compiled (``torch.compile``) as plain functions."""
    for klass in cls.__mro__:
        for name, value in list(vars(klass).items()):
            eager = _compiled_original(value)
            if eager is not None:
                _set(klass, name, eager)


def _patch_compiled_functions() -> None:
    """Megatron's ``jit_fuser`` is ``torch.compile``: on a CPU each compiled function's first
    call builds C++ for 15-20 s in every rank process, a case's whole time limit. Modules
    loaded later get Megatron's own no-op decorator; loaded ones their plain functions back."""
    jit = _module("megatron.core.jit")
    _set(jit, "jit_fuser", _attribute(jit, "noop_decorator"))
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or not isinstance(module, types.ModuleType):
            continue
        for attr, value in list(vars(module).items()):
            eager = _compiled_original(value)
            if eager is not None:
                _set(module, attr, eager)
            elif isinstance(value, type) and value.__module__ == name:
                _eager_methods(value)


_GDN_KERNELS = frozenset({"l2norm", "chunk_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d"})


def _patch_gdn_kernels() -> None:
    layer = _attribute(_module("megatron.core.ssm.gated_delta_net"), "GatedDeltaNet")
    from shardcheck.megatron.cpu import kernels

    for home, names in _globals_read(layer).items():
        for name in _GDN_KERNELS & names:
            _set_missing(home, name, getattr(kernels, name))
        if vars(home).get("HAVE_FLA") is False:
            _set(home, "HAVE_FLA", True)
    _eager_methods(layer)


def _patch_mamba_kernels() -> None:
    from shardcheck.megatron.cpu import kernels

    _stub_triton_tensor_ops()
    mamba_mixer = _module("megatron.core.ssm.mamba_mixer")
    if _attribute(mamba_mixer, "HAVE_MAMBA_SSM"):
        raise NotNeeded("mamba_ssm is installed")
    for name in ("causal_conv1d_fn", "mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"):
        _set_missing(mamba_mixer, name, getattr(kernels, name))
    _set(mamba_mixer, "ExtendedRMSNorm", _gated_norm_class(mamba_mixer.ExtendedRMSNorm, kernels))
    _set(mamba_mixer, "RMSNormGated", kernels.RMSNormGated)
    _set(mamba_mixer, "HAVE_MAMBA_SSM", True)


PATCHES: tuple[tuple[str, Callable[[], None]], ...] = (
    ("rng", _patch_rng), ("recompute", _patch_recompute), ("current_device", _patch_current_device),
    ("torch_norm_sp", _patch_torch_norm), ("synchronize", _patch_synchronize),
    ("streams", _patch_streams), ("te_gemm_name", _patch_te_gemm_name),
    ("host_copy", _patch_host_copy), ("uneven_collectives", _patch_uneven_collectives),
    ("llava_te_attention", _patch_llava_te_attention), ("clip_norm", _patch_clip_norm),
    ("gdn_kernels", _patch_gdn_kernels), ("mamba_kernels", _patch_mamba_kernels),
    ("compiled_functions", _patch_compiled_functions),
)


def patch_status() -> dict[str, str]:
    """Each patch of the last :func:`apply_cpu_patches`: ``"applied"`` or why it was not needed."""
    return dict(_status)


def apply_cpu_patches() -> None:
    """Make megatron-core run on the CPU of this process; a second call does nothing."""
    global _mode
    if _mode is not None:
        return
    _status.clear()
    for name, patch in PATCHES:
        try:
            patch()
            _status[name] = APPLIED
        except NotNeeded as why:
            _status[name] = f"{NOT_NEEDED}: {why}"
    _mode = CudaToCpuMode()
    _mode.__enter__()


def remove_cpu_patches() -> None:
    """Undo :func:`apply_cpu_patches`, restoring every original."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    _patches.restore()


def cpu_patches_active() -> bool:
    """Whether :func:`apply_cpu_patches` is in effect in this process."""
    return _mode is not None
