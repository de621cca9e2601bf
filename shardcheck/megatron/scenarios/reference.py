"""Global weights and gradients of a Megatron model, from its own ``sharded_state_dict`` metadata.

Megatron describes where each local parameter sits in its global tensor (key, global shape,
offset, prepended layer axes; GLU ``fc1`` through a factory that splits it in two). We use
that description both ways:

- :func:`load_global_weights` fills every local parameter from global tensors that depend only
  on the key, so a sharded model and the one-rank reference start from the same global weights
  whatever the layout (fused QKV, GLU ``fc1`` and pipeline stages included);
- :func:`gather_global` rebuilds global tensors (gradients, updated weights) from every rank's
  local pieces, and measures how far replicas of the same piece disagree.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from shardcheck.megatron.checks.shards import ParamShards, param_shards
from shardcheck.megatron.checks.typecheck import MESH_AXES, harness_typed
from shardcheck.parity import transport
from shardcheck.typecheck.types import R


@dataclass(frozen=True)
class Piece:
    """A local piece of a global tensor: where it goes, and its values."""

    key: str
    global_shape: tuple[int, ...]
    index: tuple
    value: torch.Tensor


def _index(piece: ShardedTensor) -> tuple:
    prepend = piece.prepend_axis_num
    offsets = piece.global_offset
    return tuple(offsets[:prepend]) + tuple(
        slice(o, o + n) for o, n in zip(offsets[prepend:], piece.local_shape, strict=True))


def seeded_global(key: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A global tensor that depends only on (key, shape, seed): N(0, 0.05), norms near 1; the
    same on every rank, so replicated (R) on every axis of a checked region."""
    return harness_typed(seeded_values(key, shape, seed), **dict.fromkeys(MESH_AXES, R))


def seeded_values(key: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """:func:`seeded_global`'s values, not typed: :func:`load_global_weights` fills parameters
    with them, which the checker types from Megatron's metadata."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.05
    if key.endswith("weight") and any("norm" in part for part in key.split(".")[-2:]):
        values += 1.0
    return values


# keys whose global tensors are one value throughout (:func:`uniform_weights`), and the site of
# the sharded_state_dict that lays out each one's parameter
_UNIFORM: dict[str, str | None] = {}


@contextmanager
def uniform_weights(keys: tuple[str, ...]) -> Iterator[dict[str, str | None]]:
    """Within the block, :func:`load_global_weights` fills the pieces of these global keys with
    one value throughout, so that no layout of them across ranks can change a number
    (:mod:`shardcheck.megatron.audit.param_layouts`); yields, per key it filled, the
    ``file:line in Class.sharded_state_dict`` that lays out its parameter (:func:`layout_owner`)."""
    _UNIFORM.clear()
    _UNIFORM.update(dict.fromkeys(keys))
    try:
        yield _UNIFORM
    finally:
        _UNIFORM.clear()


def layout_owner(model: torch.nn.Module, name: str) -> str | None:
    """Where the checkpoint layout of parameter ``name`` is made: the ``sharded_state_dict`` of
    the innermost module holding it whose class defines its own outside megatron-core's generic
    layers and base module (a layer's own splitting of its fused projection), else None."""
    from shardcheck.megatron.checks.explicit import GENERIC
    from shardcheck.megatron.checks.paths import megatron_path

    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        module = model.get_submodule(".".join(parts[:depth]))
        owner = next((c for c in type(module).__mro__ if "sharded_state_dict" in vars(c)), None)
        code = getattr(inspect.unwrap(vars(owner)["sharded_state_dict"]), "__code__", None) if owner else None
        path = megatron_path(code.co_filename) if code is not None else ""
        if path.startswith("megatron/core/") and not path.startswith((*GENERIC, "megatron/core/transformer/module.py")):
            return f"{path}:{code.co_firstlineno} in {owner.__name__}.sharded_state_dict"
    return None


@torch.no_grad()
def load_global_weights(model: torch.nn.Module, seed: int = 0,
                        make: Callable[[str, tuple[int, ...], int], torch.Tensor] = seeded_values,
                        ) -> None:
    """Fill every parameter of ``model`` with its piece of the global tensor ``make(key, ...)``."""
    cache: dict[str, torch.Tensor] = {}
    for entry in param_shards(model):
        for piece in entry.build(entry.param.data):
            if piece.key not in cache:
                cache[piece.key] = make(piece.key, tuple(piece.global_shape), seed)
                if piece.key in _UNIFORM:
                    cache[piece.key] = torch.full_like(cache[piece.key], cache[piece.key].mean().item())
                    _UNIFORM[piece.key] = layout_owner(model, entry.name)
            piece.data.copy_(cache[piece.key][_index(piece)])


def local_pieces(model: torch.nn.Module, tensor_of: Callable[[torch.nn.Parameter], torch.Tensor | None],
                 ) -> list[Piece]:
    """This rank's pieces of ``tensor_of(param)`` (a gradient, the weight) for every parameter."""
    pieces = []
    for entry in param_shards(model):
        tensor = tensor_of(entry.param)
        if tensor is None:
            continue
        for piece in entry.build(tensor.detach().reshape(entry.param.shape)):
            pieces.append(Piece(piece.key, tuple(piece.global_shape), _index(piece),
                                piece.data.detach().clone()))
    return pieces


def assemble(pieces_per_rank: list[list[Piece]]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Global tensors (in the pieces' dtype) from all ranks' pieces, and per key the largest
    replica disagreement."""
    tensors: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    filled: dict[str, torch.Tensor] = {}
    spread: dict[str, float] = {}
    for pieces in pieces_per_rank:
        for piece in pieces:
            if piece.key not in tensors:
                tensors[piece.key] = torch.zeros(piece.global_shape, dtype=torch.float64)
                dtypes[piece.key] = piece.value.dtype
                filled[piece.key] = torch.zeros(piece.global_shape, dtype=torch.bool)
                spread[piece.key] = 0.0
            seen = filled[piece.key][piece.index]
            if seen.any():
                gap = (tensors[piece.key][piece.index] - piece.value.double())[seen]
                spread[piece.key] = max(spread[piece.key], gap.abs().max().item())
            else:
                tensors[piece.key][piece.index] = piece.value.double()
                filled[piece.key][piece.index] = True
    unfilled = [k for k, f in filled.items() if not f.all()]
    if unfilled:
        raise ValueError(f"no rank holds part of: {unfilled}")
    return {k: t.to(dtypes[k]) for k, t in tensors.items()}, spread


def gather_global(model: torch.nn.Module,
                  tensor_of: Callable[[torch.nn.Parameter], torch.Tensor | None],
                  group: dist.ProcessGroup | None = None,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Every rank of ``group`` gets the global tensors of ``tensor_of`` and replica spreads."""
    mine = local_pieces(model, tensor_of)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    everyone: list = [None] * size
    if size > 1:  # the pieces as raw bytes: torch would pickle each tensor as a torch.save file
        dist.all_gather_object(everyone, transport.dumps(mine), group=group)
        everyone = [transport.loads(data) for data in everyone]
    else:
        everyone = [mine]
    return assemble(everyone)


def gradient_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient Megatron accumulated for ``param``: ``main_grad`` under DDP, else ``grad``."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def counted_in_grad_norm(model: torch.nn.Module, optimizer: object) -> dict[str, torch.Tensor]:
    """Per global tensor, the squared gradient that Megatron's gradient norm counts (called
    after the step: of the gradients as it clipped them), summed over each optimizer's
    grad-stats group: on one rank, the whole squared gradient of each.
    A parameter whose gradient the norm counts on one tp rank only (a shard taken for a
    replica) shows up as a share of it. Empty when a gradient the norm counts is no model
    parameter's (the distributed optimizer's shards)."""
    entries = {id(e.param): e for e in param_shards(model)}
    counted: dict[str, float] = {}
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        mine = _counted_masses(chained, entries)
        if mine is None:
            return {}
        group = chained.get_grad_stats_parallel_group()
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        for masses in everyone:
            for key, mass in masses.items():
                counted[key] = counted.get(key, 0.0) + mass
    return {f"norm_counted/{key}": torch.tensor(mass) for key, mass in counted.items()}  # of float32 gradients


def _counted_masses(optimizer: object, entries: dict[int, ParamShards]) -> dict[str, float] | None:
    """This rank's squared gradient per key over the gradients ``optimizer``'s norm counts."""
    owners = {}
    for main, param in _main_params(optimizer):
        if id(param) in entries:
            for grad in (main.grad, getattr(main, "decoupled_grad", None)):
                if grad is not None:
                    owners[id(grad)] = entries[id(param)]
    grads_for_norm = (getattr(optimizer, "get_grads_for_grad_norm", None)  # 0.19
                      or optimizer.get_main_grads_for_grad_norm)()
    masses: dict[str, float] = {}
    for grad in grads_for_norm:
        entry = owners.get(id(grad))
        if entry is None:
            return None
        for piece in entry.build(grad.detach().reshape(entry.param.shape)):
            masses[piece.key] = masses.get(piece.key, 0.0) + piece.data.double().square().sum().item()
    return masses


def _main_params(optimizer: object) -> Iterator[tuple[torch.Tensor, torch.nn.Parameter]]:
    """(the parameter the optimizer steps, the model parameter it stands for)."""
    halves = getattr(optimizer, "float16_groups", None)
    mains = getattr(optimizer, "fp32_from_float16_groups", None)
    if halves is not None and mains is not None:
        for half_group, main_group in zip(halves, mains, strict=True):
            yield from zip(main_group, half_group, strict=True)
    for param in optimizer.get_parameters():
        yield param, param


# ---- where each parameter's tensor parallelism was declared --------------------------------

TP_MARK = "tensor_model_parallel"
REDUCE_MARK = "allreduce"  # which DDP buffer (dense or expert) reduces the parameter's gradient


@dataclass
class _Declarations:
    """What an open :func:`parameter_declarations` block records."""

    by_id: dict[int, str] = field(default_factory=dict)  # tp declarations, by parameter id
    by_key: dict[str, str] = field(default_factory=dict)  # the same (and metrics), by global key
    reduce_sites: dict[int, str] = field(default_factory=dict)  # allreduce declarations, by parameter id
    whole: dict[int, str] = field(default_factory=dict)  # global keys of parameters cut over no group


_RECORDERS: list[_Declarations] = []


def check_gradients_where_built(module: torch.nn.Module) -> None:
    """In a checked run, each reduced gradient against its parameter's type, reported where
    megatron-core's constructor assigns the parameter's module
    (:func:`~shardcheck.megatron.checks.typecheck.construction_site`): the line that built it
    without the metadata it needs, whichever model or layer holds it."""
    from shardcheck.megatron.checks.typecheck import construction_site
    from shardcheck.typecheck.checker import current
    from shardcheck.typecheck.gradients import check_gradients

    if current() is None:
        return
    by_site: dict[str | None, dict[str, torch.Tensor]] = {}
    for name, param in module.named_parameters():
        by_site.setdefault(construction_site(module, name), {})[name] = param
    for site, params in by_site.items():
        check_gradients(params, at=site)


OUTSIDE = "outside megatron-core"


def _megatron_line(full: bool = False) -> str:
    """``file:line in function`` of the innermost megatron-core frame calling here (``full``: the
    file's own path, else its path in megatron-core)."""
    from shardcheck.megatron.checks.paths import megatron_path

    frame = sys._getframe(2)
    while frame is not None and "/megatron/core/" not in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return OUTSIDE
    file = frame.f_code.co_filename if full else megatron_path(frame.f_code.co_filename)
    return f"{file}:{frame.f_lineno} in {frame.f_code.co_name}"


RECORDED = "recorded at "  # a logged metric's declaration: the call that handed it to its tracker
# megatron-core's trackers of the metrics its training loop logs: (module, class, method), and the
# outputs (scenarios' names) that a call's bound arguments feed
METRIC_TRACKERS: tuple[tuple[str, str, str, Callable[[dict], list[str]]], ...] = (
    ("megatron.core.transformer.moe.moe_logging", "MoEMetricsTracker", "record",
     lambda bound: [f"moe/{bound['name']}"]),
    ("megatron.core.transformer.multi_token_prediction", "MTPLossLoggingHelper", "save_metrics_to_tracker",
     lambda bound: [f"mtp/mtp_{bound['layer_number'] + 1} loss",
                    f"mtp/mtp_{bound['layer_number'] + 1}_acceptance_rate"]),
    ("megatron.core.transformer.multi_token_prediction", "MTPLossLoggingHelper", "save_loss_to_tracker",
     lambda bound: [f"mtp/mtp_{bound['layer_number'] + 1} loss"]),
)


def _metric_recorders(by_key: dict[str, str]) -> list[tuple[Any, str, Any]]:
    """Patches of this megatron-core's metric trackers (:data:`METRIC_TRACKERS`) that note in
    ``by_key``, per output a call feeds, the megatron-core line that made the call: where the
    metric's groups (what it is reduced and averaged over) are chosen."""
    import importlib
    import inspect

    patches = []
    for module, owner, method, outputs in METRIC_TRACKERS:
        try:
            cls = getattr(importlib.import_module(module), owner, None)
        except ImportError:  # a release without the tracker (moe_logging is 0.19's)
            continue
        original = getattr(cls, method, None)
        if original is None:
            continue

        def noting(*args: Any, _original: Any = original, _outputs: Any = outputs, **kwargs: Any) -> Any:
            site = f"{RECORDED}{_megatron_line()}"
            for name in _outputs(inspect.signature(_original).bind(*args, **kwargs).arguments):
                by_key.setdefault(name, site)
            return _original(*args, **kwargs)

        static = isinstance(inspect.getattr_static(cls, method), staticmethod)
        patches.append((cls, method, staticmethod(noting) if static else noting))
    return patches


def recorded_at(declared: dict[str, str], name: str) -> str | None:
    """``file:line in function`` of the call that recorded the logged metric ``name``
    (:func:`parameter_declarations`), or None (not a metric, or not recorded)."""
    found = declared.get(name, "")
    return found.removeprefix(RECORDED) if found.startswith(RECORDED) else None


@contextmanager
def parameter_declarations() -> Iterator[dict[str, str]]:
    """Where megatron-core declared the tensor parallelism of each parameter built inside the
    block, by global key, for the models :func:`note_declarations` is given: the last line that
    set its ``tensor_model_parallel`` (in megatron-core, or where megatron-core called the code
    that did, such as Transformer Engine's), else the line that built it (registered it in a
    module). A parameter the gradient norm counts wrongly is declared there. A metric the
    training loop logs is declared, by its output name, where megatron-core recorded it in its
    tracker (:data:`RECORDED`, :func:`recorded_at`): the call that gives its groups. The line
    that set each parameter's ``allreduce`` is kept too (:func:`check_reduction_declarations`)."""
    from shardcheck.patching import patched_attrs

    recorder = _Declarations()
    by_id = recorder.by_id
    register, setter = torch.nn.Module.register_parameter, torch.nn.Parameter.__setattr__

    def registering(module: torch.nn.Module, name: str, param: Any, *args: Any, **kwargs: Any) -> Any:
        if param is not None and id(param) not in by_id:
            by_id[id(param)] = f"has no {TP_MARK} (built at {_megatron_line()})"
        return register(module, name, param, *args, **kwargs)

    def marking(param: torch.nn.Parameter, name: str, value: Any) -> None:
        if name == TP_MARK:
            by_id[id(param)] = f"has {TP_MARK}={value!r} from {_megatron_line()}"
        elif name == REDUCE_MARK and (line := _megatron_line(full=True)) != OUTSIDE:
            recorder.reduce_sites[id(param)] = line
        setter(param, name, value)

    _RECORDERS.append(recorder)
    try:
        with patched_attrs([(torch.nn.Module, "register_parameter", registering),
                            (torch.nn.Parameter, "__setattr__", marking),
                            *_metric_recorders(recorder.by_key)]):
            yield recorder.by_key
    finally:
        _RECORDERS.remove(recorder)


def note_declarations(model: torch.nn.Module) -> None:
    """Give the open :func:`parameter_declarations` blocks the global keys of ``model``'s
    parameters, and which parameters its ``sharded_state_dict`` cuts along none of their own
    dims (it may stack layers or experts: a parameter cut over a tensor-parallel group holds
    another piece on each of its ranks). Nothing when no block is open."""
    from shardcheck.megatron.checks.typing import cut_dims

    for recorder in _RECORDERS:
        for entry in param_shards(model):
            pieces = entry.build(entry.param.data)
            if id(entry.param) in recorder.by_id:
                for piece in pieces:
                    recorder.by_key.setdefault(piece.key, recorder.by_id[id(entry.param)])
            if pieces and not any(cut_dims(piece) for piece in pieces):
                recorder.whole[id(entry.param)] = pieces[0].key


def check_reduction_declarations(ddp: Any) -> None:
    """In a checked run inside :func:`parameter_declarations`, each parameter of ``ddp`` noted
    whole (:func:`note_declarations`: cut over no group) whose ``allreduce`` picks a DDP buffer
    whose group misses an axis its gradient breaks its type on, reported at the megatron-core
    line that set it (:func:`~shardcheck.megatron.checks.reduction.check_reduction_groups`).
    It reads no group from ``parallel_state`` (which would move where a global-group use is
    located: the last megatron-core line that read the group)."""
    from shardcheck.megatron.checks.reduction import check_reduction_groups

    for recorder in _RECORDERS:
        check_reduction_groups(ddp, recorder.reduce_sites, recorder.whole)
