"""Explicit process groups: a ``ProcessGroupCollection`` whose groups differ from the global ones.

Megatron's modules, DDP, the schedules, ``finalize_model_grads`` and the optimizer accept
``pg_collection=``: the groups they should use instead of ``parallel_state``'s globals. For a
layout with explicit groups (e.g. ``tp2-dp2@dp-tp``: tensor-parallel groups {0,2},{1,3} while
the global ones stay {0,1},{2,3}) this module

* builds that collection (:func:`explicit_collection`): each field's group is found from the
  global one, by the dimensions its ranks span (tp x cp for ``tp_cp``, ...), and re-made with
  ``dist.new_group`` over the explicit layout's ranks that span the same dimensions;
* records code that ignores it (:func:`global_group_uses`): a collective issued on one of
  ``parallel_state``'s global groups whose ranks differ from the collection's group of the
  same field, with the line that issued it (in megatron-core, or in our own harness);
* gives the corrected control (:func:`globals_follow_explicit`): ``parallel_state``'s globals
  pointed at the collection's groups, so code that reads them gets the explicit groups.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from math import prod
from typing import Any

import torch.distributed as dist

from shardcheck.parity.layout import BASE_DIMS, Layout
from shardcheck.patching import patched_attrs

RULE = "global group"
FIX = "explicit-groups"
FIX_NOTE = ("issue the collective on the model's pg_collection group (pass it through instead of "
            "reading parallel_state's global group)")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "_all_gather_base", "_reduce_scatter_base", "broadcast", "all_to_all_single",
               "reduce_scatter", "reduce")
# parallel_state's global for each field the corrected control points at the explicit group.
_GLOBALS = {"tp": "_TENSOR_MODEL_PARALLEL_GROUP", "pp": "_PIPELINE_MODEL_PARALLEL_GROUP",
            "mp": "_MODEL_PARALLEL_GROUP", "cp": "_CONTEXT_PARALLEL_GROUP",
            "tp_cp": "_TENSOR_AND_CONTEXT_PARALLEL_GROUP", "dp": "_DATA_PARALLEL_GROUP",
            "dp_cp": "_DATA_PARALLEL_GROUP_WITH_CP", "tp_dp_cp": "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
            "ep": "_EXPERT_MODEL_PARALLEL_GROUP", "expt_tp": "_EXPERT_TENSOR_PARALLEL_GROUP",
            "tp_ep": "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
            "tp_ep_pp": "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
            "expt_dp": "_EXPERT_DATA_PARALLEL_GROUP", "embd": "_EMBEDDING_GROUP",
            "pos_embd": "_POSITION_EMBEDDING_GROUP"}
_made: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}
_uses: list[list[dict]] = []
_routing: list[bool] = []


class ExplicitGroupsUnsupported(ValueError):
    """A global group whose ranks do not span whole dimensions of the layout."""


def ranks_of(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def spanned_dims(layout: Layout, ranks: tuple[int, ...]) -> tuple[str, ...]:
    """The base dimensions on which the ranks' coordinates in ``layout`` differ; the ranks must
    be all the ranks that differ only there."""
    coords = [layout.coords(r) for r in ranks]
    dims = tuple(d for d in BASE_DIMS if len({c[d] for c in coords}) > 1)
    if len(ranks) != prod(layout.size(d) for d in dims):
        raise ExplicitGroupsUnsupported(f"group {list(ranks)} does not span whole dimensions of {layout}")
    return dims


def _group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A group over ``ranks``, made once per process (among its members only)."""
    key = (id(dist.distributed_c10d._world.default_pg), ranks)
    if key not in _made:
        _made[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _made[key]


def explicit_collection(layout: Layout, rank: int) -> Any:
    """The ``ProcessGroupCollection`` of ``layout``'s explicit groups (``parallel_state`` must be
    initialised with its global groups). Every rank of the layout calls it; each makes its own
    groups, in the same order (see :func:`shardcheck.megatron.cpu.parallel.megatron_parallel`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    chosen: dict[str, Any] = {}
    for name, var in sorted(_GLOBALS.items()):
        group = getattr(ps, var, None)
        if not isinstance(group, dist.ProcessGroup):
            chosen[name] = group
            continue
        dims = spanned_dims(layout.global_layout, ranks_of(group))
        chosen[name] = _group(next(g for g in layout.spanning(dims) if rank in g))
    chosen.update(intra_dp_cp=chosen["dp_cp"], intra_expt_dp=chosen["expt_dp"],
                  inter_dist_opt=None, intra_dist_opt=None, hcp=None)
    return ProcessGroupCollection(**chosen)


def check_against(pg: Any, groups: dict[str, dist.ProcessGroup]) -> None:
    """The collection's tp/cp/dp/pp/dp_cp groups hold the same ranks as the layout's own."""
    for axis in ("tp", "cp", "dp", "pp", "dp_cp"):
        if axis in groups and ranks_of(getattr(pg, axis)) != ranks_of(groups[axis]):
            raise ExplicitGroupsUnsupported(
                f"explicit {axis} group {list(ranks_of(getattr(pg, axis)))} differs from the "
                f"layout's {list(ranks_of(groups[axis]))}")


def check_mesh(pg: Any) -> None:
    """The active type checker's axes hold the collection's groups: the mesh it types with is
    :func:`~shardcheck.megatron.checks.typing.mesh_from_pg_collection` of the collection."""
    from shardcheck.megatron.checks.typing import mesh_from_pg_collection
    from shardcheck.typecheck.checker import current

    checker = current()
    if checker is None:
        return
    expected = mesh_from_pg_collection(pg).axes
    for name, axis in checker.mesh.axes.items():
        if name in expected and expected[name].ranks != axis.ranks:
            raise ExplicitGroupsUnsupported(
                f"the type checker's {name} axis {list(axis.ranks)} is not the explicit "
                f"pg_collection's {list(expected[name].ranks)}")


def _short(path: str) -> str:
    for marker in ("/megatron/core/", "/shardcheck/", "/tests/"):
        index = path.rfind(marker)
        if index >= 0:
            return path[index + 1:]
    return path


def _caller() -> str:
    """file:line of the code that issued the collective (the caller of the probe)."""
    frame = traceback.extract_stack(limit=3)[0]
    return f"{_short(frame.filename)}:{frame.lineno}"


def _replaced(pg: Any) -> dict[int, tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """By id of a global group: its field, its ranks and the collection's, where they differ."""
    from megatron.core import parallel_state as ps

    found = {}
    for name, var in _GLOBALS.items():
        group, mine = getattr(ps, var, None), getattr(pg, name, None)
        if isinstance(group, dist.ProcessGroup) and isinstance(mine, dist.ProcessGroup) \
                and ranks_of(group) != ranks_of(mine):
            found[id(group)] = (name, ranks_of(group), ranks_of(mine))
    return found


@contextmanager
def global_group_uses(pg: Any) -> Iterator[list[dict]]:
    """Record every collective issued on a global group that the collection replaces with
    different ranks; each record is a violation dict (rule, location, op, line)."""
    misused = _replaced(pg)
    found: list[dict] = []
    seen: set[tuple[str, str]] = set()
    inside: list[str] = []

    def probed(op: str, original: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if inside:  # the same call dispatched again (e.g. through a TorchFunctionMode)
                return original(*args, **kwargs)
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            hit = misused.get(id(group)) if group is not None else None
            if hit is not None and (op, location := _caller()) not in seen:
                seen.add((op, location))
                name, used, meant = hit
                found.append({"rule": RULE, "location": location, "op": op, "group": name,
                              "line": f"checker: {location}: {op} on parallel_state's global {name} "
                                      f"group {list(used)}, but the model's pg_collection.{name} "
                                      f"is {list(meant)}"})
            inside.append(op)
            try:
                return original(*args, **kwargs)
            finally:
                inside.pop()
        run.__name__ = getattr(original, "__name__", op)
        return run

    namespaces = (dist, dist.distributed_c10d)
    saved = [(ns, op, getattr(ns, op)) for ns in namespaces for op in COLLECTIVES if hasattr(ns, op)]
    wrapped = {id(original): probed(op, original) for _, op, original in saved}
    try:
        with patched_attrs([(ns, op, wrapped[id(original)]) for ns, op, original in saved]):
            yield found
    finally:
        if _uses:
            _uses[-1].extend(found)


@contextmanager
def recording() -> Iterator[list[dict]]:
    """Collect the global-group uses of every explicit run inside the block."""
    records: list[dict] = []
    _uses.append(records)
    try:
        yield records
    finally:
        _uses.pop()


@contextmanager
def routed(enabled: bool = True) -> Iterator[None]:
    """Inside the block, explicit runs point ``parallel_state``'s globals at their explicit
    groups (the corrected control of a global-group finding)."""
    _routing.append(enabled)
    try:
        yield
    finally:
        _routing.pop()


@contextmanager
def globals_follow_explicit(pg: Any) -> Iterator[None]:
    """``parallel_state``'s globals are the collection's groups inside the block, when asked
    for by :func:`routed`."""
    from megatron.core import parallel_state as ps

    if not (_routing and _routing[-1]):
        yield
        return
    explicit: dict[int, Any] = {}
    for name, var in _GLOBALS.items():
        if getattr(pg, name, None) is not None and getattr(ps, var, None) is not None:
            explicit.setdefault(id(getattr(ps, var)), getattr(pg, name))
    # every global holding one of those groups follows it: 0.19's data-parallel getters read
    # aliases of them (``_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT`` without GTP remat)
    followed = [(ps, var, explicit[id(value)]) for var, value in vars(ps).items()
                if isinstance(value, dist.ProcessGroup) and id(value) in explicit]
    with patched_attrs(followed):
        yield
