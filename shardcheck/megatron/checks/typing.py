"""Type Megatron models without porting them: meshes, parameters and inputs from Megatron's metadata.

* :func:`mesh_from_parallel_state` / :func:`mesh_from_pg_collection`: a checker mesh whose axes
  are Megatron's groups (tp, cp, dp, ep, etp, pp), or the groups of an explicit
  ``ProcessGroupCollection``, which may differ from the global ones.
* :func:`parameter_types`: each parameter's placement per axis, read from the attributes Megatron
  sets on it: ``tensor_model_parallel`` + ``partition_dim`` -> S(partition_dim) on tp (on etp for
  experts; sectioned for fused weights, and from the ``sharded_state_dict`` cut where the
  attribute is missing, see :func:`tp_layouts`); ``sequence_parallel`` -> R, whose gradient
  must be reduced over tp; expert parameters (``allreduce=False``) -> S(0) on ep and, by the
  ranks of their groups, on cp and dp: S(0) over the ep ranks, V over a group spanning other
  ep ranks (which hold other experts), R otherwise; everything
  else R; every parameter R over dp and V over pp (each pipeline stage holds its own layers,
  so a stage's values are no replica of another's).
* :func:`input_types`: tokens, labels, loss mask and position ids by role: V over dp and ep
  (ep is cut from dp x cp), S(seq) over cp (Megatron's load-balanced chunk order: rank r holds
  chunks r and 2*cp-1-r), R over tp.
* :func:`annotate_model` / :func:`annotate_batch` apply them in an active ``sc.typecheck``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from shardcheck.typecheck.types import Mesh, Placement, R, S, SectionShard, V, parse_alternatives

AXES = ("tp", "cp", "dp", "ep", "etp", "pp")
INPUT_ROLES = ("tokens", "input_ids", "labels", "loss_mask", "position_ids", "attention_mask",
               "padding_mask")
_PG_FIELDS = {"tp": "tp", "cp": "cp", "dp": "dp", "ep": "ep", "etp": "expt_tp", "pp": "pp"}


def mesh_from_parallel_state() -> Mesh:
    """A mesh over Megatron's global groups from ``parallel_state`` (which must be initialised)."""
    from megatron.core import parallel_state as ps

    getters = {"tp": ps.get_tensor_model_parallel_group, "cp": ps.get_context_parallel_group,
               "dp": ps.get_data_parallel_group, "ep": ps.get_expert_model_parallel_group,
               "etp": ps.get_expert_tensor_parallel_group,
               "pp": ps.get_pipeline_model_parallel_group}
    return Mesh(**{axis: get() for axis, get in getters.items()})


def mesh_from_pg_collection(pg_collection: Any) -> Mesh:
    """A mesh over the groups of a ``ProcessGroupCollection`` (tp, cp, dp, ep, etp, pp where set)."""
    groups = {axis: getattr(pg_collection, field, None) for axis, field in _PG_FIELDS.items()}
    present = {axis: group for axis, group in groups.items() if group is not None}
    if "tp" not in present:
        raise ValueError("the ProcessGroupCollection has no tp group")
    return Mesh(**present)


@dataclass(frozen=True)
class ParamType:
    """A parameter's placement per axis, and the axes its gradient must be reduced over."""

    placements: dict[str, Placement]
    grad_reduced_over: tuple[str, ...] = ()
    reason: str = ""


def is_expert(param: torch.nn.Parameter) -> bool:
    """Megatron marks expert parameters ``allreduce=False`` (they are not all-reduced over dp)."""
    return getattr(param, "allreduce", True) is False


@dataclass(frozen=True)
class TpLayout:
    """Where Megatron's ``sharded_state_dict`` puts a parameter's tensor-parallel cut: the local
    dim it is cut along, and for a fused weight the local lengths of its sections."""

    dim: int
    sections: tuple[int, ...] | None = None


def parameter_type(param: torch.nn.Parameter, axes: tuple[str, ...] = AXES,
                   layout: TpLayout | None = None) -> ParamType:
    """The type of one Megatron parameter from its own attributes (see the module docstring).

    ``layout`` (from :func:`tp_layouts`) marks a fused weight's shard as sectioned, and types a
    parameter that lacks the ``tensor_model_parallel`` attribute: Megatron's parallel linear
    layers set it only when they initialise the weight (``perform_initialization``), yet the
    weight is cut all the same.
    """
    expert = is_expert(param)
    tp_axis = "etp" if expert else "tp"
    placements: dict[str, Placement] = dict.fromkeys(axes, R)
    if "pp" in placements:  # each pipeline stage holds its own layers: no replica over pp
        placements["pp"] = V
    reduced: tuple[str, ...] = ()
    if getattr(param, "tensor_model_parallel", False):
        dim = int(getattr(param, "partition_dim", 0))
        sections = layout.sections if layout is not None and layout.dim == dim else None
        placements[tp_axis] = SectionShard(dim, sections) if sections else S(dim)
        reason = f"tensor_model_parallel, partition_dim={getattr(param, 'partition_dim', 0)}"
    elif not hasattr(param, "tensor_model_parallel") and layout is not None:
        placements[tp_axis] = SectionShard(layout.dim, layout.sections) if layout.sections \
            else S(layout.dim)
        reason = f"no tensor_model_parallel attribute; sharded_state_dict cuts dim {layout.dim}"
    elif getattr(param, "sequence_parallel", False):
        reduced = ("tp",)
        reason = "sequence_parallel: replicated, gradient reduced over tp"
    else:
        reason = "replicated"
    if expert and "ep" in placements:
        placements["ep"] = S(0)
        reason += "; expert (allreduce=False): S(0) on ep"
        if "tp" in placements and _expert_tp_is_tp():  # the tp ranks are the etp ranks
            placements["tp"] = placements[tp_axis]
        for axis, placement in _expert_placements_by_ranks().items():
            if axis in placements:
                placements[axis] = placement
                reason += f", {placement!r} on {axis}"
    elif "ep" in placements and "tp" in placements and _ep_is_tp():
        placements["ep"] = placements["tp"]  # the same ranks: the same cut
        reduced += ("ep",) if "tp" in reduced else ()
    return ParamType({axis: placements[axis] for axis in axes}, reduced, reason)


def _expert_placements_by_ranks() -> dict[str, Placement]:
    """An expert's placement on cp and dp, from their groups' ranks against the ep group's:
    over the ep ranks themselves, S(0) as on ep; sharing other ep ranks (which hold other
    experts), V; else R (the ranks hold the same experts). dp is V where the groups are
    unknown (parallel_state not initialised)."""
    from megatron.core import parallel_state as ps

    getters = {"cp": ps.get_context_parallel_group, "dp": ps.get_data_parallel_group}
    if not _expert_tp_is_tp():  # experts not cut over tp (etp != tp): tp is one more group
        getters["tp"] = ps.get_tensor_model_parallel_group
    try:
        ep = set(_ranks(ps.get_expert_model_parallel_group()))
        groups = {axis: set(_ranks(get())) for axis, get in getters.items()}
    except (AssertionError, AttributeError, RuntimeError):  # parallel_state not initialised
        return {"dp": V}
    return {axis: S(0) if ranks == ep else V if len(ranks & ep) > 1 else R
            for axis, ranks in groups.items()}


def _ranks(group: Any) -> list[int]:
    return torch.distributed.get_process_group_ranks(group)


def _expert_tp_is_tp() -> bool:
    """Whether Megatron cuts the experts over the dense layers' tp ranks (its default
    ``expert_tensor_parallel_size``): then a mesh's tp axis carries an expert's etp cut."""
    from megatron.core import parallel_state as ps

    return _holds_the_tp_ranks(ps.get_expert_tensor_parallel_group)


def _ep_is_tp() -> bool:
    """Whether the expert-parallel ranks are the tp ranks (an etp other than tp, ep = tp:
    Megatron's expert grid then cuts ep from the tp ranks)."""
    from megatron.core import parallel_state as ps

    return _holds_the_tp_ranks(ps.get_expert_model_parallel_group)


def _holds_the_tp_ranks(get_group: Any) -> bool:
    """Whether parallel_state's group from ``get_group`` holds this rank's tp ranks (two or more)."""
    from megatron.core import parallel_state as ps

    try:
        group, tp = get_group(), ps.get_tensor_model_parallel_group()
    except (AssertionError, AttributeError, RuntimeError):  # parallel_state not initialised
        return False
    if group is None or tp is None:
        return False
    ranks = _ranks(tp)
    return len(ranks) > 1 and _ranks(group) == ranks


def tp_layouts(module: torch.nn.Module) -> dict[int, TpLayout]:
    """By parameter id, the :class:`TpLayout` of every parameter that Megatron's
    ``sharded_state_dict`` cuts along one dim: local pieces shorter than the global tensor.
    Several pieces along that dim are the sections of a fused weight (GatedDeltaNet's and
    Mamba's ``in_proj`` and ``conv1d``, GLU ``fc1``). Empty for a module without
    sharded-state-dict metadata."""
    from shardcheck.megatron.checks.shards import param_shards

    try:
        shards = param_shards(module)
    except (AttributeError, ValueError):
        return {}
    found = {}
    for entry in shards:
        pieces = entry.build(entry.param.data)
        dims = {d for piece in pieces for d in cut_dims(piece)}
        if len(dims) != 1:
            continue
        (dim,) = dims
        lengths = tuple(piece.local_shape[dim] for piece in pieces)
        fused = len(pieces) > 1 and sum(lengths) == entry.param.shape[dim]
        found[id(entry.param)] = TpLayout(dim, lengths if fused else None)
    return found


def cut_dims(piece: Any) -> list[int]:
    """The local dims of a sharded-tensor piece that are shorter than its global tensor's."""
    lead = piece.prepend_axis_num
    return [d for d, size in enumerate(piece.local_shape) if size != piece.global_shape[lead + d]]


_TYPED_FROM = ("allreduce", "tensor_model_parallel", "partition_dim", "sequence_parallel")
_UNSET = "<unset>"


def type_inputs(module: torch.nn.Module) -> tuple:
    """What :func:`parameter_types` reads of ``module``: each parameter's name, identity, shape
    and the Megatron attributes :func:`parameter_type` reads, whether the experts are cut over
    the tp ranks and how the cp and dp groups lie against ep. Equal inputs give equal types, so the types of a module may be kept
    between steps while its inputs stay the same."""
    named = list(module.named_parameters())
    params = tuple((name, id(p), tuple(p.shape), tuple(getattr(p, a, _UNSET) for a in _TYPED_FROM))
                   for name, p in named)
    experts = any(is_expert(p) for _, p in named)
    return (params, experts and _expert_tp_is_tp(), experts and tuple(_expert_placements_by_ranks().items()),
            _ep_is_tp())


def parameter_types(module: torch.nn.Module, axes: tuple[str, ...] = AXES) -> dict[str, ParamType]:
    """Every named parameter's :class:`ParamType`, with the layouts of :func:`tp_layouts`."""
    layouts = tp_layouts(module)
    return {name: parameter_type(param, axes, layouts.get(id(param)))
            for name, param in module.named_parameters()}


def input_types(role: str, axes: tuple[str, ...] = AXES, seq_dim: int = 1) -> dict[str, Placement]:
    """The placement per axis of a batch input by role (``tokens``, ``labels``, ...).

    Batches are [batch, seq]: V over dp (each data-parallel rank has its own samples) and ep
    (whose ranks are data-parallel or context-parallel ones), S(seq) over cp, R over tp and
    the other axes.
    """
    if role not in INPUT_ROLES:
        raise ValueError(f"unknown input role {role!r}; known: {', '.join(INPUT_ROLES)}")
    types: dict[str, Placement] = dict.fromkeys(axes, R)
    # ep is cut from dp x cp: its ranks hold other samples or other sequence chunks; or, with
    # an etp other than tp, it may be the tp ranks, which hold the same
    ep = R if _ep_is_tp() else V
    types.update({axis: p for axis, p in (("dp", V), ("ep", ep), ("cp", S(seq_dim))) if axis in axes})
    return types


def _known(mesh_axes: tuple[str, ...], types: Mapping[str, Placement]) -> dict[str, Placement]:
    return {axis: p for axis, p in types.items() if axis in mesh_axes}


def annotate_model(module: torch.nn.Module, mesh_axes: tuple[str, ...]) -> int:
    """Annotate every parameter of ``module`` in the active typecheck; returns how many."""
    import shardcheck as sc
    from shardcheck.typecheck.checker import current

    checker = current()
    with checker.paused() if checker is not None else nullcontext():  # metadata is no program
        types = parameter_types(module)
    for name, param in module.named_parameters():
        sc.annotate(param, **_known(mesh_axes, types[name].placements))
    return len(types)


def annotate_batch(batch: Mapping[str, Any], mesh_axes: tuple[str, ...]) -> None:
    """Annotate the tensors of a batch dict whose keys are input roles."""
    import shardcheck as sc

    for role, value in batch.items():
        if role in INPUT_ROLES and isinstance(value, torch.Tensor):
            seq_dim = 2 if role == "attention_mask" else 1
            sc.annotate(value, **_known(mesh_axes, input_types(role, seq_dim=seq_dim)))


def load_balanced_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2*cp``) that Megatron gives CP rank ``cp_rank``."""
    return cp_rank, 2 * cp - 1 - cp_rank


def assume_required(fn: Any, requires: Mapping[str, Mapping[str, str]], args: tuple,
                    kwargs: Mapping[str, Any]) -> None:
    """Give arguments the checker does not know yet the placements a contract requires.

    A contract's precondition is taken as the assumption for values that came from code
    without types (e.g. a tensor a test built itself); known types are checked, not replaced.
    """
    import inspect

    import shardcheck as sc
    from shardcheck.typecheck.checker import current

    checker = current()
    if checker is None:
        return
    bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    for name, types in requires.items():
        value = bound.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        known = sc.typeof(value)
        missing = {axis: parse_alternatives(p)[0] for axis, p in types.items()
                   if axis in checker.names and axis not in known}
        if missing:
            sc.annotate(value, **missing)
