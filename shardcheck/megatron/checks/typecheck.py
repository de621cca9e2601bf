"""The type checker around a Megatron run: the mesh of the rank's layout, and the violations it found.

Nothing in megatron-core is ported. Inside the region:

* every module's parameters, its submodules' included, are typed from Megatron's metadata
  (:func:`shardcheck.megatron.checks.typing.parameter_type`) when DDP wraps the model (it reads
  every parameter to lay out its buffers) or else the first time the module runs (a layer
  may use a submodule's parameters without calling it: Mamba's context parallelism slices
  its ``conv1d`` weights);
* the batch Megatron cuts for context parallelism (``get_batch_on_this_cp_rank``) is typed by
  role (:func:`shardcheck.megatron.checks.typing.annotate_batch`), and MTP's shift of it by a token
  (``roll_tensor``, point to point between CP ranks) keeps its placements;
* contracted functions check their arguments (:mod:`shardcheck.megatron.checks.contracts`);
* every parameter's gradient (``param.main_grad``, followed through DDP's buffer collectives)
  is checked against the parameter's type before the optimizer step.

Violations are collected (mode ``"collect"``), deduplicated by rule and location, and returned
as dicts with ``rule``, ``location``, ``op`` and ``line`` (the ``checker:`` line).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import re
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from shardcheck.megatron.checks.paths import megatron_path
from shardcheck.megatron.checks.pipeline_types import received_activations_typed
from shardcheck.patching import patched, patched_attrs

MESH_AXES = ("tp", "cp", "dp", "ep", "pp")


def layout_mesh(ctx: Any):
    """The checker mesh over the layout's groups of more than one rank (the same ranks as
    Megatron's own groups). A one-rank axis is left out: every value is trivially whole there,
    and Megatron skips its collectives on it."""
    import torch.distributed as dist

    from shardcheck.typecheck.types import Mesh

    groups = {axis: ctx.groups[axis] for axis in MESH_AXES
              if axis in ctx.groups and dist.get_world_size(ctx.groups[axis]) > 1}
    return Mesh(rank=ctx.rank, **groups)


_TYPES_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _types_by_id(module: torch.nn.Module) -> dict[int, Any]:
    """Each parameter's :class:`~shardcheck.megatron.checks.typing.ParamType`, by parameter id.

    Reading them walks Megatron's ``sharded_state_dict`` (milliseconds a step): they are kept
    per module, and read again when what they are read from changed (a parameter replaced,
    reshaped or given other attributes: :func:`~shardcheck.megatron.checks.typing.type_inputs`)."""
    from shardcheck.megatron.checks.typing import parameter_types, type_inputs

    inputs = type_inputs(module)
    kept = _TYPES_KEPT.get(module)
    if kept is not None and kept[0] == inputs:
        return kept[1]
    types = parameter_types(module)
    by_id = {id(param): types[name] for name, param in module.named_parameters()}
    _TYPES_KEPT[module] = (inputs, by_id)
    return by_id


@contextlib.contextmanager
def _parameters_typed_on_first_use(axes: tuple[str, ...]) -> Iterator[None]:
    import shardcheck as sc
    from shardcheck.typecheck.checker import current
    typed: set[int] = set()
    walked: weakref.WeakSet = weakref.WeakSet()  # modules whose whole tree was typed

    def type_parameters(module: torch.nn.Module, _args: Any) -> None:
        if module in walked and all(p is None or id(p) in typed
                                    for p in module._parameters.values()):
            return  # a parameter set on a submodule since is typed when that one runs
        walked.update(module.modules())  # typed below with the whole tree: no walk of each
        fresh = {name: p for name, p in module.named_parameters() if id(p) not in typed}
        if not fresh:
            return
        with current().paused():
            types = _types_by_id(module)
        sc.annotate_parameters(fresh)  # named: norm accounting follows their gradients' counts
        for param in fresh.values():  # Megatron's metadata wins over what setup code did to it
            typed.add(id(param))
            placements = types[id(param)].placements
            sc.annotate(param, **{a: p for a, p in placements.items() if a in axes})

    from megatron.core.distributed import DistributedDataParallel

    original_init = DistributedDataParallel.__init__

    def typed_init(self, config, ddp_config, module, *args: Any, **kwargs: Any) -> None:
        type_parameters(module, ())  # DDP reads every parameter to lay out its buffers
        original_init(self, config, ddp_config, module, *args, **kwargs)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(type_parameters)
    try:
        with patched(DistributedDataParallel, "__init__", typed_init):
            yield
    finally:
        handle.remove()


_HOLDERS: dict[tuple[str, int], tuple[int, list]] = {}


def holders(prefix: str, original: Any) -> list:
    """The loaded modules named ``prefix...`` that hold ``original`` under its own name.

    A module's own namespace is read (``vars``), never its attributes: a few have a slow
    module ``__getattr__``. A checked region looks up several functions: the modules are
    scanned again only when more were loaded, and the ones found are checked to hold it still."""
    import sys

    key, count, name = (prefix, id(original)), len(sys.modules), original.__name__
    cached = _HOLDERS.get(key)
    if cached is None or cached[0] != count:
        found = [module for module_name, module in list(sys.modules.items())
                 if module_name.startswith(prefix) and _holds(module, name, original)]
        _HOLDERS[key] = cached = (count, found)
    return [module for module in cached[1] if _holds(module, name, original)]


def _holds(module: Any, name: str, value: Any) -> bool:
    return getattr(module, "__dict__", {}).get(name) is value


def _replaced_everywhere(original: Any, replacement: Any) -> contextlib.AbstractContextManager:
    """Replace a megatron-core function in every megatron module that refers to it."""
    return patched_attrs([(module, original.__name__, replacement)
                          for module in holders("megatron", original)])


@contextlib.contextmanager
def _tp_duplicates_checked() -> Iterator[None]:
    """Megatron counts a parameter in the gradient norm on every TP rank, or on tp rank 0 only
    when ``param_is_not_tensor_parallel_duplicate`` takes it for a replica. That test reads the
    ``tensor_model_parallel`` attribute, which the parallel linear layers and the embedding set
    only when they initialise their weights: a parameter typed S on tp (cut, by its
    sharded_state_dict) that the test calls a replica is reported where Megatron asks."""
    from megatron.core.tensor_parallel import layers

    from shardcheck.typecheck.checker import current
    from shardcheck.typecheck.types import Shard
    from shardcheck.typecheck.violations import Violation

    original = layers.param_is_not_tensor_parallel_duplicate

    def checked(param: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        counted = original(param, *args, **kwargs)
        checker = current()
        if not counted and checker is not None and "tp" in checker.names:
            axis = checker.names.index("tp")
            if isinstance((checker.types(param) or (None,) * checker.n)[axis], Shard):
                checker.report(Violation("shard counted as replica", axis,
                                         "no tensor_model_parallel attribute: only tp rank 0's "
                                         "piece of this parameter is counted"),
                               original.__name__, (param,))
        return counted

    with _replaced_everywhere(original, checked):
        yield


@contextlib.contextmanager
def _initial_weights_typed(axes: tuple[str, ...]) -> Iterator[None]:
    """Megatron's CPU initialisation builds the whole weight alike on every rank and copies
    this rank's chunk along ``partition_dim`` into the parameter (through ``weight.data``),
    before it marks the parameter's other roles (``allreduce`` is set after it): there the
    parameter is S(partition_dim) on tp and R on cp, its other axes unknown until its metadata
    types it (when DDP lays out its buffers, or on first use). A chunk of strided pieces, or
    one cut over a group of another size than tp, is left untyped."""
    import inspect

    from megatron.core.tensor_parallel import layers

    from shardcheck.typecheck.checker import current
    from shardcheck.typecheck.types import R, S

    original = layers._initialize_affine_weight_cpu
    signature = inspect.signature(original)

    def typed(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        whole = given["output_size"] if given["partition_dim"] == 0 else given["input_size"]
        checker = current()
        placements = {"cp": R} if "cp" in axes else {}
        if (checker is not None and "tp" in axes and given["stride"] == 1
                and whole == given["per_partition_size"] * checker.sizes[checker.names.index("tp")]):
            placements["tp"] = S(given["partition_dim"])
        if checker is None or not placements:
            return original(*args, **kwargs)
        known = tuple(placements.get(axis) for axis in checker.names)
        checker.set_type(given["weight"], known)
        result = original(*args, **kwargs)
        checker.set_type(given["weight"], known)  # not the master weight's type on the other axes
        return result

    typed.__name__, typed.__wrapped__ = original.__name__, original  # type: ignore[attr-defined]
    with _replaced_everywhere(original, typed):
        yield


@contextlib.contextmanager
def _local_experts_cut_by_ep() -> Iterator[None]:
    """The allgather dispatcher takes its local experts' columns of the gathered routing map
    and probabilities, a chunk by the ep rank (``local_expert_indices``): where tp or dp have
    ep's size, the checker cannot tell which group's rank chose it unless told."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from shardcheck.typecheck.rules.shape import rank_chunks_by

    original = MoEAllGatherTokenDispatcher.dispatch_postprocess

    @functools.wraps(original)
    def by_ep(*args: Any, **kwargs: Any) -> Any:
        with rank_chunks_by("ep"):
            return original(*args, **kwargs)

    with patched(MoEAllGatherTokenDispatcher, "dispatch_postprocess", by_ep):
        yield


@contextlib.contextmanager
def _context_parallel_cuts_typed(axes: tuple[str, ...]) -> Iterator[None]:
    """Type what Megatron cuts for this CP rank with a rank-dependent index (which the checker
    reads as replicated data): the batch by role, and the rotary position embedding as
    S(seq_dim) over cp, in Megatron's load-balanced chunk order."""
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rope_utils

    import shardcheck as sc
    from shardcheck.megatron.checks.typing import annotate_batch
    from shardcheck.typecheck.types import S

    batch_cut, rope_cut = utils.get_batch_on_this_cp_rank, rope_utils.get_pos_emb_on_this_cp_rank

    def typed_batch(batch, *args: Any, **kwargs: Any):
        result = batch_cut(batch, *args, **kwargs)
        annotate_batch(result, axes)
        return result

    def typed_rope(pos_emb, seq_dim, cp_group, *args: Any, **kwargs: Any):
        result = rope_cut(pos_emb, seq_dim, cp_group, *args, **kwargs)
        return sc.annotate(result, cp=S(seq_dim)) if "cp" in axes else result

    typed_batch.__name__, typed_rope.__name__ = batch_cut.__name__, rope_cut.__name__
    typed_batch.__wrapped__, typed_rope.__wrapped__ = batch_cut, rope_cut  # their signatures
    with _replaced_everywhere(batch_cut, typed_batch), _replaced_everywhere(rope_cut, typed_rope):
        yield


@contextlib.contextmanager
def _sequence_rolls_typed() -> Iterator[None]:
    """MTP's ``roll_tensor`` shifts a sequence by one token, trading the boundary tokens of
    each CP chunk with the neighbouring CP ranks point to point: the rolled tensor keeps the
    input's placements, and the sum it returns is partial where the input is a shard."""
    from megatron.core.transformer import multi_token_prediction as mtp

    import shardcheck as sc
    from shardcheck.typecheck.checker import current
    from shardcheck.typecheck.types import P, Shard

    original = mtp.roll_tensor

    def typed_roll(tensor, *args: Any, **kwargs: Any):
        checker = current()
        if checker is None or tensor is None:
            return original(tensor, *args, **kwargs)
        types = sc.typeof(tensor)
        with checker.paused():
            rolled, total = original(tensor, *args, **kwargs)
        sc.annotate(rolled, **types)
        sc.annotate(total, **{axis: P if isinstance(p, Shard) else p for axis, p in types.items()})
        return rolled, total

    typed_roll.__name__, typed_roll.__wrapped__ = original.__name__, original  # type: ignore[attr-defined]
    with _replaced_everywhere(original, typed_roll):
        yield


@contextlib.contextmanager
def _gradient_buffers_typed(axes: tuple[str, ...]) -> Iterator[None]:
    """After DDP zeroes its gradient buffer, each ``param.main_grad`` (a view of it) is a known
    zero with its parameter's layout: gradients accumulate into it whatever their placement.
    Each is registered as a view of the buffer, so that DDP's collectives on the whole buffer
    (the bucket all-reduce over dp x cp) retype it, and the gradient check at
    ``optimizer.step`` sees the reduced gradient."""
    from megatron.core.distributed import DistributedDataParallel

    from shardcheck.typecheck import tensor_state
    from shardcheck.typecheck.checker import current
    from shardcheck.typecheck.rules.registry import Known

    original = DistributedDataParallel.zero_grad_buffer

    def typed_zero(self, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        checker = current()
        if checker is None:
            return result
        with checker.paused():
            types = _types_by_id(self.module)
        for param in self.module.parameters():
            main_grad = getattr(param, "main_grad", None)
            if isinstance(main_grad, torch.Tensor):
                placements = types[id(param)].placements
                checker.set_type(main_grad, tuple(placements.get(a) for a in checker.names), Known.ZERO)
                if main_grad._base is not None and tensor_state.read(main_grad, "root") is None:
                    checker.register_view(main_grad, main_grad._base)  # DDP reduces the buffer
        return result

    with patched(DistributedDataParallel, "zero_grad_buffer", typed_zero):
        yield


@contextlib.contextmanager
def _memory_buffers_typed() -> Iterator[None]:
    """Megatron's ``GlobalMemoryBuffer.get_tensor`` hands out a view of a buffer it keeps
    between calls (and between runs), to be overwritten like a fresh ``torch.empty``: the
    buffer is typed as ``torch.empty``'s result is (R) before each view is cut from it."""
    from megatron.core.utils import GlobalMemoryBuffer

    from shardcheck.typecheck.checker import current
    from shardcheck.typecheck.types import R

    original = GlobalMemoryBuffer.get_tensor

    def typed(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        checker = current()
        if checker is not None:
            for buffer in self.buffer.values():
                checker.set_type(buffer, (R,) * checker.n)
        return original(self, *args, **kwargs)

    with patched(GlobalMemoryBuffer, "get_tensor", typed):
        yield


OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list")


@contextlib.contextmanager
def _object_collectives_untyped() -> Iterator[None]:
    """Collectives of Python objects move metadata (e.g. parameter names), not laid-out tensors:
    their internal byte tensors are not typed."""
    import torch.distributed as dist

    from shardcheck.typecheck.checker import current

    def untyped(original):
        def run(*args: Any, **kwargs: Any) -> Any:
            checker = current()
            with checker.paused() if checker else contextlib.nullcontext():
                return original(*args, **kwargs)
        return run

    with patched_attrs([(dist, name, untyped(getattr(dist, name))) for name in OBJECT_COLLECTIVES]):
        yield


@contextlib.contextmanager
def _received_tensors_untyped() -> Iterator[None]:
    """A tensor received from another pipeline stage holds what the sender sent, which this
    rank cannot type: after the receive, the buffer is unknown (not R from its ``empty``, nor
    V from the receive itself)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from shardcheck.typecheck.checker import current

    def forget(tensor: torch.Tensor) -> None:
        checker = current()
        if checker is not None:
            checker.set_type(tensor, None)

    def batched(original):
        def run(p2p_ops, *args: Any, **kwargs: Any) -> Any:
            result = original(p2p_ops, *args, **kwargs)
            for op in p2p_ops:
                if getattr(op.op, "__name__", "") in ("irecv", "recv"):
                    forget(op.tensor)
            return result
        return run

    def receiving(original):
        def run(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            result = original(tensor, *args, **kwargs)
            forget(tensor)
            return result
        run.__name__ = original.__name__
        return run

    saved = [(namespace, name, getattr(namespace, name)) for namespace in (dist, distributed_c10d)
             for name in ("batch_isend_irecv", "recv", "irecv")]
    replaced = {id(original): (batched if name == "batch_isend_irecv" else receiving)(original)
                for _, name, original in saved}
    # one object per function in both namespaces
    with patched_attrs([(namespace, name, replaced[id(original)]) for namespace, name, original in saved]):
        yield


_HARNESS_AXES: list[tuple[str, ...]] = []  # the mesh axes of each open harness_values_typed


@contextlib.contextmanager
def harness_values_typed(axes: tuple[str, ...]) -> Iterator[None]:
    """Inside, :func:`harness_typed` declares the harness's values on the mesh axes ``axes``."""
    _HARNESS_AXES.append(axes)
    try:
        yield
    finally:
        _HARNESS_AXES.pop()


def harness_typed(value: torch.Tensor, **placements: Any) -> torch.Tensor:
    """``value``, from a harness helper whose result the checker cannot see through (a global
    tensor drawn from a fixed seed, this rank's chunk of one), with its ``placements`` on the
    axes of the checked region around it; outside one, ``value`` as it is."""
    known = {axis: p for axis, p in placements.items() if _HARNESS_AXES and axis in _HARNESS_AXES[-1]}
    if not known:
        return value
    import shardcheck as sc

    return sc.annotate(value, **known)


@contextlib.contextmanager
def checked_region(ctx: Any, ops: dict | None = None) -> Iterator[list[dict]]:
    """Type-check the block in collect mode; the yielded list receives its violations at exit.

    With ``ops`` (a dict), the op calls made from megatron-core's own files are counted by
    source location, and ``ops`` receives them at exit (:func:`megatron_ops`).
    """
    found: list[dict] = []
    import shardcheck as sc

    mesh = layout_mesh(ctx)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_parameters_typed_on_first_use(mesh.names))
        stack.enter_context(_initial_weights_typed(mesh.names))
        stack.enter_context(_context_parallel_cuts_typed(mesh.names))
        stack.enter_context(_local_experts_cut_by_ep())
        stack.enter_context(_sequence_rolls_typed())
        stack.enter_context(_object_collectives_untyped())
        stack.enter_context(harness_values_typed(mesh.names))
        stack.enter_context(_received_tensors_untyped())
        stack.enter_context(received_activations_typed())
        stack.enter_context(_gradient_buffers_typed(mesh.names))
        stack.enter_context(_tp_duplicates_checked())
        stack.enter_context(_memory_buffers_typed())
        stack.enter_context(contextlib.redirect_stderr(io.StringIO()))  # the region's summary
        checker = stack.enter_context(sc.typecheck(mesh, mode="collect", sites=ops is not None))
        yield found
    if ops is not None:
        ops.update(megatron_ops(checker.coverage()))
    found.extend({**v.as_dict(), "location": megatron_path(v.location),
                  "line": v.first_line.replace(v.location, megatron_path(v.location))}
                 for v in sc.violations() if _in_megatron(v.location))


def megatron_ops(coverage: Any) -> dict[str, Any]:
    """The op calls of a :class:`~shardcheck.typecheck.checker.Coverage` (counted by site) that
    megatron-core's own files made: typed, unknown, and the unknown ones by ``file:line`` and
    by the origin of their unknown (``file:line op: cause``, wherever it began)."""
    import os

    import megatron.core

    inside = coverage.within(os.path.dirname(megatron.core.__file__) + os.sep)
    return {"typed": inside.typed, "unknown": inside.unknown,
            "unknown_at": {megatron_path(loc): unknown for loc, _, unknown in inside.by_site if unknown},
            "unknown_from": {_short_origin(origin): n for origin, n in inside.origins}}


def _short_origin(origin: str) -> str:
    """An origin (``file:line op: cause``) with its file shortened as :func:`megatron_path` does."""
    location, _, rest = origin.partition(" ")
    return f"{megatron_path(location)} {rest}"


def _in_megatron(location: str) -> bool:
    """Violations located in our own harness (scenario set-up, gathering results) are not
    findings about megatron-core; they are left to the harness's own tests."""
    return "/megatron/core/" in location


GENERIC_LIBRARIES = ("torch.", "transformer_engine.", "builtins")  # their modules' owners build them


def construction_site(root: torch.nn.Module, name: str) -> str | None:
    """``file:line`` where parameter ``name`` of ``root`` is built: the ``self.A_log = ...`` of
    the class that holds it (megatron-core's), or, for a parameter of a generic module (torch's or
    Transformer Engine's norm ``weight``), the ``self.out_norm = ...`` of that module's owner,
    whose constructor gives it its metadata. None when no class's source assigns it."""
    *path, leaf = name.split(".")
    site = _assignment(type(root.get_submodule(".".join(path))), leaf)
    if site is None and path:
        site = _assignment(type(root.get_submodule(".".join(path[:-1]))), path[-1])
    return site


@functools.cache
def _assignment(cls: type, attribute: str) -> str | None:
    """``file:line`` of the first ``self.<attribute> = ...`` in the sources of ``cls``'s classes
    that are not torch's or Transformer Engine's (a library's module is generic: its owner builds it).
    Cached: reading a class's source parses its whole file, and every case asks again."""
    assignment = re.compile(rf"^\s*self\.{re.escape(attribute)}\s*(:[^=]+)?=[^=]")
    for base in (c for c in cls.__mro__ if not c.__module__.startswith(GENERIC_LIBRARIES)):
        try:
            lines, first = inspect.getsourcelines(base)
        except (OSError, TypeError):
            continue
        for offset, line in enumerate(lines):
            if assignment.match(line):
                return f"{inspect.getsourcefile(base)}:{first + offset}"
    return None
