"""Type Megatron models without porting them: meshes, parameters and inputs from Megatron's metadata.

* :func:`mesh_from_parallel_state` / :func:`mesh_from_pg_collection`: a checker mesh whose axes
  are Megatron's groups (tp, cp, dp, ep, etp, pp), or the groups of an explicit
  ``ProcessGroupCollection``, which may differ from the global ones.
* :func:`parameter_types`: each parameter's placement per axis, read from the attributes Megatron
  sets on it: ``tensor_model_parallel`` + ``partition_dim`` -> S(partition_dim) on tp (on etp for
  experts; sectioned for fused weights, see :func:`fused_sections`); ``sequence_parallel`` -> R,
  whose gradient must be reduced over tp; expert parameters (``allreduce=False``) -> S(0) on ep;
  everything else R; every parameter R over dp and V over pp (each pipeline stage holds its own
  layers, so a stage's values are no replica of another's).
* :func:`input_types`: tokens, labels, loss mask and position ids by role: V over dp, S(seq)
  over cp (Megatron's load-balanced chunk order: rank r holds chunks r and 2*cp-1-r), R over tp.
* :func:`annotate_model` / :func:`annotate_batch` apply them in an active ``sc.typecheck``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardcheck.rules import SectionShard
from shardcheck.types import Mesh, Placement, R, S, V, parse_placement

AXES = ("tp", "cp", "dp", "ep", "etp", "pp")
INPUT_ROLES = ("tokens", "input_ids", "labels", "loss_mask", "position_ids", "attention_mask")
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


def parameter_type(param: torch.nn.Parameter, axes: tuple[str, ...] = AXES,
                   sections: tuple[int, ...] | None = None) -> ParamType:
    """The type of one Megatron parameter from its own attributes (see the module docstring);
    ``sections`` (from :func:`fused_sections`) marks a fused weight's shard as sectioned."""
    expert = is_expert(param)
    tp_axis = "etp" if expert else "tp"
    placements: dict[str, Placement] = dict.fromkeys(axes, R)
    if "pp" in placements:  # each pipeline stage holds its own layers: no replica over pp
        placements["pp"] = V
    reduced: tuple[str, ...] = ()
    if getattr(param, "tensor_model_parallel", False):
        dim = int(getattr(param, "partition_dim", 0))
        placements[tp_axis] = SectionShard(dim, sections) if sections else S(dim)
        reason = f"tensor_model_parallel, partition_dim={getattr(param, 'partition_dim', 0)}"
    elif getattr(param, "sequence_parallel", False):
        reduced = ("tp",)
        reason = "sequence_parallel: replicated, gradient reduced over tp"
    else:
        reason = "replicated"
    if expert:
        placements["ep"] = S(0)
        reason += "; expert (allreduce=False): S(0) on ep"
    return ParamType({axis: placements[axis] for axis in axes}, reduced, reason)


def fused_sections(module: torch.nn.Module) -> dict[int, tuple[int, ...]]:
    """By parameter id, the local section lengths of fused tensor-parallel weights: those that
    Megatron's ``sharded_state_dict`` splits into several pieces along their partition dim
    (GatedDeltaNet's and Mamba's ``in_proj`` and ``conv1d``, GLU ``fc1``). Empty for a module
    without sharded-state-dict metadata."""
    from shardcheck.megatron.reference import param_shards

    try:
        shards = param_shards(module)
    except (AttributeError, ValueError):
        return {}
    found = {}
    for entry in shards:
        dim = int(getattr(entry.param, "partition_dim", 0))
        pieces = entry.build(entry.param.data)
        lengths = tuple(piece.local_shape[dim] for piece in pieces)
        if (getattr(entry.param, "tensor_model_parallel", False) and len(pieces) > 1
                and sum(lengths) == entry.param.shape[dim]):
            found[id(entry.param)] = lengths
    return found


def parameter_types(module: torch.nn.Module, axes: tuple[str, ...] = AXES) -> dict[str, ParamType]:
    """Every named parameter's :class:`ParamType`."""
    return {name: parameter_type(param, axes) for name, param in module.named_parameters()}


def input_types(role: str, axes: tuple[str, ...] = AXES, seq_dim: int = 1) -> dict[str, Placement]:
    """The placement per axis of a batch input by role (``tokens``, ``labels``, ...).

    Batches are [batch, seq]: V over dp (each data-parallel rank has its own samples), S(seq)
    over cp, R over tp and the other axes.
    """
    if role not in INPUT_ROLES:
        raise ValueError(f"unknown input role {role!r}; known: {', '.join(INPUT_ROLES)}")
    types: dict[str, Placement] = dict.fromkeys(axes, R)
    types.update({axis: p for axis, p in (("dp", V), ("cp", S(seq_dim))) if axis in axes})
    return types


def _known(mesh_axes: tuple[str, ...], types: Mapping[str, Placement]) -> dict[str, Placement]:
    return {axis: p for axis, p in types.items() if axis in mesh_axes}


def annotate_model(module: torch.nn.Module, mesh_axes: tuple[str, ...]) -> int:
    """Annotate every parameter of ``module`` in the active typecheck; returns how many."""
    import shardcheck as sc

    count = 0
    for _, param in module.named_parameters():
        sc.annotate(param, **_known(mesh_axes, parameter_type(param).placements))
        count += 1
    return count


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
    from shardcheck.checker import current

    checker = current()
    if checker is None:
        return
    bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    for name, types in requires.items():
        value = bound.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        known = sc.typeof(value)
        missing = {axis: parse_placement(p) for axis, p in types.items()
                   if axis in checker.names and axis not in known}
        if missing:
            sc.annotate(value, **missing)
