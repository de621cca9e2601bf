"""Megatron's ``parallel_state`` for a scenario's layout, on Gloo, set up and torn down per run.

Megatron keeps its process groups in module globals of ``parallel_state``. For a layout we call
its own ``initialize_model_parallel`` with two adjustments, so that it also works on the first
ranks of a larger world (the warm rank pool): while the scenario runs, the layout's world group
(``ctx.groups['world']``) stands in for the default group, so Megatron's world-size reads and
default-group collectives (e.g. the optimizer's ``all_gather_object``) stay among the layout's
ranks; and each group is created with local synchronisation (only its members take part). The
groups it builds are checked against the layout's own groups when the context has them.

Groups are created once per layout and process: the state is saved after the first
initialisation and restored on the next run of the same layout, so that a long sweep does not
open Gloo groups without end; Megatron's global memory buffer is made anew (its tensors belong
to the run that made them: in a later run's type-checked region they would enter untyped). ``destroy_model_parallel`` runs after every scenario (it destroys
only the extra ``*_GLOO`` groups, which are not made here). Each Gloo group keeps a thread polling its
sockets, so a rank process also reuses groups between layouts: a one-rank group is made once,
and a field's group (Megatron's ``group_desc``) over ranks it had in an earlier layout is the
group made then. Groups of different fields stay distinct objects, over the same ranks too:
:mod:`~shardcheck.megatron.checks.explicit` tells fields apart by their group objects.

A layout with explicit groups (``tp2-dp2@dp-tp``) initialises ``parallel_state`` with its
global (default-order) groups, and :func:`megatron_parallel` yields the
``ProcessGroupCollection`` of its explicit groups (:mod:`shardcheck.megatron.checks.explicit`) for the
scenario to pass to Megatron; without explicit groups it yields None.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.megatron.cpu.caches import forget_function_caches
from shardcheck.megatron.cpu.patches import apply_cpu_patches
from shardcheck.megatron.cpu.te import forget_cached_tensors, unquantised
from shardcheck.patching import patched, patched_attrs

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_saved: dict[tuple, dict[str, Any]] = {}
_created: dict[tuple[int, ...], int] = {}
_reusable: dict[tuple, dist.ProcessGroup] = {}


class LayoutUnsupported(ValueError):
    """A layout Megatron's global ``parallel_state`` cannot express on this process group."""


def _world(layout: Any) -> int:
    return layout.tp * layout.cp * layout.dp * layout.pp


def _check(layout: Any) -> None:
    if _world(layout) > dist.get_world_size():
        raise LayoutUnsupported(
            f"layout needs {_world(layout)} ranks; the process group has {dist.get_world_size()}")
    if layout.sp and layout.tp == 1:
        raise LayoutUnsupported("sequence parallelism needs tp > 1")


def _state_names(parallel_state) -> list[str]:
    return [n for n in vars(parallel_state) if n.startswith("_") and n[1:2].isupper()
            and n.upper() == n]


def _reuse_key(ranks: list[int] | None, kwargs: dict[str, Any]) -> tuple | None:
    """The key of a group this rank may reuse: a one-rank group by its rank, another by its
    ranks (sorted, as torch sorts them) and field (``group_desc``); None for a non-member, a
    field-less group or pg_options."""
    if not ranks or dist.get_rank() not in ranks or kwargs.get("pg_options") is not None:
        return None
    field = kwargs.get("group_desc") if len(ranks) > 1 else None
    if len(ranks) > 1 and field is None:
        return None
    return tuple(sorted(ranks)), field, kwargs.get("backend"), kwargs.get("timeout")


def _reused(key: tuple, handed: set[tuple]) -> dist.ProcessGroup | None:
    """The live group made earlier under ``key``, unless that field already got it in this
    initialisation (two groups of one field stay distinct; one-rank groups are shared).

    Every member of a group takes the same decision: creating a group over some ranks needs
    all of them, so they all made (and kept) the same groups over those ranks before.
    """
    group = _reusable.get(key)
    if group is None or group not in dist.distributed_c10d._world.pg_map:
        return None
    return None if key[1] is not None and key in handed else group


@contextmanager
def _local_groups() -> Iterator[None]:
    """Megatron creates each group among its members only, under a name its members agree on,
    or gets one this process made before (:func:`_reused`).

    torch names a locally synchronised group by its ranks and the number of groups this process
    already has, which differs between ranks that ran different layouts in a pool; the name
    used here counts only earlier groups over the same ranks, which every member created too.
    """
    from megatron.core import parallel_state

    c10d = dist.distributed_c10d
    original_create, original_name = parallel_state.create_group, c10d._process_group_name
    handed: set[tuple] = set()

    def local_group(ranks=None, **kwargs):
        kwargs["use_local_synchronization"] = True
        key = _reuse_key(ranks, kwargs)
        if key is None:
            return original_create(ranks, **kwargs)
        group = _reused(key, handed)
        if group is None:
            group = _reusable[key] = original_create(ranks, **kwargs)
        handed.add(key)
        return group

    def agreed_name(ranks, use_hashed_name):
        if not use_hashed_name:
            return original_name(ranks, use_hashed_name)
        key = tuple(ranks)
        _created[key] = _created.get(key, 0) + 1
        return c10d.GroupName(f"megatron:{'_'.join(map(str, key))}:{_created[key]}")

    with patched_attrs([(parallel_state, "create_group", local_group), (c10d, "_process_group_name", agreed_name)]):
        yield


@contextmanager
def _layout_as_world(ctx: Any) -> Iterator[None]:
    """The layout's world group is the default group while the scenario runs."""
    group, state = world_group(ctx), dist.distributed_c10d._world
    if group is None or group is state.default_pg:
        yield
        return
    with patched(state, "default_pg", group):
        yield


def _initialise(layout: Any) -> None:
    from megatron.core import parallel_state

    layout = getattr(layout, "global_layout", layout)
    key = (layout.tp, layout.cp, layout.dp, layout.ep, _expert_tp(layout), layout.pp,
           getattr(layout, "order", DEFAULT_ORDER), id(dist.distributed_c10d._world.default_pg))
    if key in _saved:
        for name, value in _saved[key].items():
            setattr(parallel_state, name, value)
        parallel_state._set_global_memory_buffer()  # a new one: the last held an earlier run's tensors
        return
    with _local_groups():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=_expert_tp(layout),
            order=getattr(layout, "order", DEFAULT_ORDER),
            create_gloo_process_groups=False,
        )
    _saved[key] = {n: getattr(parallel_state, n) for n in _state_names(parallel_state)
                   if n != "_GLOBAL_MEMORY_BUFFER"}


def _expert_tp(layout: Any) -> int:
    return getattr(layout, "expert_tp", layout.tp)


def _verify(ctx: Any) -> None:
    """Megatron's tp/cp/dp/pp groups hold the same ranks as the layout's own groups, and its
    expert groups those of the layout's expert grid."""
    from megatron.core import parallel_state as ps

    _verify_expert_grid(ctx)
    megatron = {"tp": ps.get_tensor_model_parallel_group(), "cp": ps.get_context_parallel_group(),
                "dp": ps.get_data_parallel_group(), "pp": ps.get_pipeline_model_parallel_group()}
    explicit = getattr(ctx.layout, "explicit_groups", None) or {}
    for axis, group in megatron.items():
        if axis in explicit:  # the explicit collection is checked against these instead
            continue
        ours = getattr(ctx, "groups", {}).get(axis)
        if ours is not None and dist.get_process_group_ranks(ours) != dist.get_process_group_ranks(group):
            raise LayoutUnsupported(
                f"Megatron's {axis} group {dist.get_process_group_ranks(group)} differs from the "
                f"layout's {dist.get_process_group_ranks(ours)}")


def _verify_expert_grid(ctx: Any) -> None:
    """Megatron's etp, ep and edp groups of this rank hold the ranks the layout computes."""
    from megatron.core import parallel_state as ps

    if getattr(ctx.layout, "explicit_groups", None) or not hasattr(ctx.layout, "group_ranks"):
        return
    megatron = {"etp": ps.get_expert_tensor_parallel_group(), "ep": ps.get_expert_model_parallel_group(),
                "edp": ps.get_expert_data_parallel_group()}
    for axis, group in megatron.items():
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks != ctx.layout.group_ranks(axis, ctx.rank):
            raise LayoutUnsupported(f"Megatron's expert {axis} group {list(ranks)} differs from the "
                                    f"layout's {list(ctx.layout.group_ranks(axis, ctx.rank))}")


def scenario_groups(pg: Any = None) -> Any:
    """The groups a scenario computes with: the explicit collection ``megatron_parallel``
    yielded, else a collection of ``parallel_state``'s tp, cp, dp and pp groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return pg if pg is not None else ProcessGroupCollection.use_mpu_process_groups(
        ["tp", "cp", "dp", "pp"])


def explicit_kwargs(pg: Any, name: str = "pg_collection") -> dict[str, Any]:
    """``{name: pg}`` for a Megatron entry point when the scenario has explicit groups, else
    nothing (Megatron then reads ``parallel_state``)."""
    return {name: pg} if pg is not None else {}


def world_group(ctx: Any) -> dist.ProcessGroup | None:
    """The group of all the layout's ranks: ``ctx.groups['world']``, else the default group."""
    return getattr(ctx, "groups", {}).get("world")


def _explicit(ctx: Any) -> Any:
    """The explicit ``ProcessGroupCollection`` of ``ctx.layout``, or None without explicit groups."""
    from shardcheck.megatron.checks import explicit

    if not getattr(ctx.layout, "explicit_groups", None):
        return None
    try:
        with _local_groups():
            pg = explicit.explicit_collection(ctx.layout, ctx.rank)
        explicit.check_against(pg, getattr(ctx, "groups", {}))
        explicit.check_mesh(pg)
    except explicit.ExplicitGroupsUnsupported as exc:
        raise LayoutUnsupported(str(exc)) from None
    return pg


@contextmanager
def _explicit_run(pg: Any) -> Iterator[None]:
    """Record global-group uses in an explicit run (and route the globals when asked for)."""
    from shardcheck.megatron.checks import explicit

    if pg is None:
        yield
        return
    with explicit.globals_follow_explicit(pg), explicit.global_group_uses(pg):
        yield


def _forget_moe_metrics() -> None:
    """Drop megatron-core's process-wide MoE metrics tracker (0.19 on), as Megatron's groups are
    dropped: its per-layer tensors are sized by the first model that used them, so a warm rank's
    next model with more layers would index past them."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # megatron-core 0.16 keeps its MoE losses in another tracker
        return
    destroy_moe_metrics_tracker()


@contextmanager
def megatron_parallel(ctx: Any, seed: int = 1234) -> Iterator[Any]:
    """Initialise Megatron's model-parallel groups and RNG for ``ctx.layout``; destroy them after.

    ``ctx`` needs ``.layout`` with ``tp, cp, dp, ep, pp, sp`` (and optionally ``order`` and
    ``explicit_groups``) and ``.rank``; its ``.groups`` (by axis name), when present, are
    checked against Megatron's. Yields the explicit ``ProcessGroupCollection`` or None.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    apply_cpu_patches()
    forget_cached_tensors()  # TE's cached tensors are built again, in this run's checked region
    forget_function_caches()  # and megatron-core's and TE's lru caches
    # A forked rank must not reuse OpenMP threads its parent started: libgomp deadlocks.
    torch.set_num_threads(1)
    _check(ctx.layout)
    with _layout_as_world(ctx):
        _initialise(ctx.layout)
        try:
            _verify(ctx)
            pg = _explicit(ctx)
            model_parallel_cuda_manual_seed(seed)
            with _explicit_run(pg), unquantised():  # FP8/FP4 recipes run unquantised on TE
                yield pg
        finally:
            parallel_state.destroy_model_parallel()
            _forget_moe_metrics()
