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
  same field, located at the line that chose the group (:func:`_chooser`): the constructor
  line that built the generic layer without the model's group, or the call that passed none,
  with the line that issued the collective as where it showed;
* gives the corrected control (:func:`globals_follow_explicit`): ``parallel_state``'s globals
  pointed at the collection's groups, so code that reads them gets the explicit groups.
"""

from __future__ import annotations

import os
import sys
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from math import prod
from types import FrameType
from typing import Any

import torch
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
# what explicit_collection gives the constructor: the collection a user builds for a model
# (derived fields such as dp_cp_gtp_remat, which only use_mpu_process_groups sets, stay unset)
CONSTRUCTED = (*sorted(_GLOBALS), "intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt", "hcp")
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
    assert set(chosen) == set(CONSTRUCTED)
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
    for marker in ("/megatron/core/", "/transformer_engine/", "/shardcheck/", "/tests/"):
        index = path.rfind(marker)
        if index >= 0:
            return path[index + 1:]
    return path


def _caller() -> str:
    """file:line of the code that issued the collective (the caller of the probe)."""
    frame = traceback.extract_stack(limit=3)[0]
    return f"{_short(frame.filename)}:{frame.lineno}"


# megatron-core's generic building blocks: their group is their caller's choice (an argument,
# or parallel_state's global when the caller passes none), so a wrong group is their caller's bug
GENERIC = ("megatron/core/tensor_parallel/", "megatron/core/utils.py", "megatron/core/parallel_state.py",
           "megatron/core/process_groups_config.py")
# modules of megatron-core's generic autograd functions (tensor_parallel.checkpoint's CheckpointFunction)
GENERIC_FUNCTIONS = "megatron.core.tensor_parallel."
# the functions of megatron.core.utils that fall back to parallel_state's global group
GROUP_DEFAULTS = ("get_tensor_model_parallel_group_if_none",)
# tensor_parallel's autograd functions whose forward keeps this rank's slice by the group's rank,
# with no collective to probe: on a global group that the collection replaces, another rank's slice
# (recorded as a split where no gradient flows back, e.g. GPTModel's MoE padding mask; else the
# backward's all-gather is recorded at the same line)
SPLITS = ("_ScatterToSequenceParallelRegion", "_ScatterToModelParallelRegion")
_MEGATRON = "/megatron/core/"


def _site(frame: FrameType) -> str:
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_qualname}"


def _chooser(frame: FrameType | None, group: Any, built: Any = None) -> str | None:
    """``file:line in function`` of the megatron-core line that chose ``group`` for a
    collective (or a group-taking call) at ``frame``. Walking out from ``frame``, a
    megatron-core function that received the group as an argument leaves the choice to its
    caller; one that received another group and used this one chose it; outside the generic
    layers (:data:`GENERIC`) one that received none chose it (it read or omitted it); inside
    them, the module whose constructor took the global group (``built``: module -> site) chose
    it there. The walk passes torch's, the standard library's and Transformer Engine's frames
    (:data:`LIBRARY`). None where it leaves megatron-core for other code (the harness chose it)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if _MEGATRON in name:
            given = _arguments(frame)
            if group is not None and any(value is group for value in given):
                pass
            elif any(isinstance(value, dist.ProcessGroup) for value in given) \
                    or not _short(name).startswith(GENERIC):
                return _site(frame)
            elif built is not None:
                owner = frame.f_locals.get("self")
                if isinstance(owner, torch.nn.Module) and owner in built:
                    return built[owner]
        elif not name.startswith(_PASSED) and LIBRARY not in name:
            return None
        frame = frame.f_back
    return None


def _arguments(frame: FrameType) -> list[Any]:
    """The values the parameters of the function running at ``frame`` hold now."""
    code = frame.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return [frame.f_locals.get(n) for n in names]


# frames the walk passes: torch, the standard library, shardcheck's probes around megatron-core
_SHARDCHECK = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PASSED = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.__file__) + os.sep,
           *(os.path.join(_SHARDCHECK, *part) for part in (("megatron", "checks", ""), ("typecheck", ""),
                                                           ("patching.py",))))


# Transformer Engine's Python, which megatron-core calls as it calls torch: its group is its
# caller's choice (te_checkpoint's checkpoint splits and gathers on the tp_group it is given)
LIBRARY = f"{os.sep}transformer_engine{os.sep}pytorch{os.sep}"


def _constructing(frame: FrameType | None) -> torch.nn.Module | None:
    """The megatron-core module whose constructor runs at ``frame`` or outside it, innermost first."""
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        if isinstance(owner, torch.nn.Module) and _MEGATRON in frame.f_code.co_filename:
            return owner
        frame = frame.f_back
    return None


def _aliases(originals: dict[int, Any]) -> list[tuple[Any, str, Any]]:
    """(module, name, original) for each loaded megatron-core module attribute that is one of
    ``originals`` (by id): ``dist_all_gather_func = torch.distributed.all_gather_into_tensor``
    binds the collective at import, out of reach of a patch of ``torch.distributed``."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("megatron.core"):
            continue
        for name, value in list(vars(module).items()):
            if id(value) in originals:
                found.append((module, name, value))
    return found


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
    different ranks; each record is a violation dict (rule, location, op, line, showed).

    ``location`` is the line that chose the group (:func:`_chooser`), ``showed`` the line that
    issued the collective. Where the group was chosen: a generic layer's constructor that falls
    back to the global (:data:`GROUP_DEFAULTS`) records its caller; an autograd function
    given the global group records its caller for its backward (run later, from no caller);
    a ``parallel_state`` getter records the megatron-core line that read the global, for a
    collective that takes the group from where that line stored it."""
    misused = _replaced(pg)
    found: list[dict] = []
    seen: set[tuple[str, str, str]] = set()
    inside: list[str] = []
    built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> chooser of its group
    nodes: dict[int, tuple[Any, str | None]] = {}  # id(grad_fn) -> (grad_fn, chooser)

    reads: dict[int, dict[str, None]] = {}  # id(global group) -> the sites that read it, last last

    def chosen(frame: FrameType | None, group: Any) -> str | None:
        node = torch._C._current_autograd_node()
        if node is not None and id(node) in nodes:
            return nodes[id(node)][1]
        root = _chooser(frame, group, built)
        read = reads.get(id(group), {})
        if root is None or not read or root in read:
            return root
        # the line that issued it read the group from a store (a tracker, an attribute): the
        # last megatron-core function that read it from parallel_state chose it
        return next(reversed(read))

    def getter(original: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if id(result) in misused:
                frame = sys._getframe(1)
                site = _chooser(frame, None)
                if site is not None:
                    read = reads.setdefault(id(result), {})
                    read.pop(site, None)
                    read[site] = None
            return result
        return run

    def note(op: str, hit: tuple[str, tuple[int, ...], tuple[int, ...]], root: str, showed: str) -> None:
        if (op, root, showed) not in seen:
            seen.add((op, root, showed))
            found.append(_use(op, hit, root, showed))

    def probed(op: str, original: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if inside:  # the same call dispatched again (e.g. through a TorchFunctionMode)
                return original(*args, **kwargs)
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            hit = misused.get(id(group)) if group is not None else None
            if hit is not None:
                showed = _caller()
                note(op, hit, chosen(sys._getframe(1), group) or showed, showed)
            inside.append(op)
            try:
                return original(*args, **kwargs)
            finally:
                inside.pop()
        run.__name__ = getattr(original, "__name__", op)
        return run

    def defaulted(original: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if id(result) in misused:
                owner = _constructing(sys._getframe(1))
                if owner is not None and owner not in built:
                    built[owner] = _chooser(sys._getframe(1), result)
            return result
        return run

    apply = torch.autograd.Function.__dict__["apply"].__func__

    def applied(cls: Any, *args: Any, **kwargs: Any) -> Any:
        result = apply(cls, *args, **kwargs)
        group = next((a for a in (*args, *kwargs.values()) if id(a) in misused), None)
        outputs = [out for out in (result if isinstance(result, tuple) else (result,))
                   if isinstance(out, torch.Tensor)]
        if group is None and cls.__module__.startswith(GENERIC_FUNCTIONS) \
                and not any(isinstance(a, dist.ProcessGroup) for a in (*args, *kwargs.values())):
            # given no group, its backward takes the global one: the megatron-core line that
            # applied it without one chose it (the decoder's recomputation, tensor_parallel.checkpoint)
            root = _chooser(sys._getframe(1), None, built)
            for out in outputs:
                if out.grad_fn is not None and root is not None:
                    nodes.setdefault(id(out.grad_fn), (out.grad_fn, root))
        if group is not None:
            root = _chooser(sys._getframe(1), group, built)
            for out in outputs:
                if out.grad_fn is not None:
                    nodes[id(out.grad_fn)] = (out.grad_fn, root)
            if cls.__name__ in SPLITS and not any(out.grad_fn is not None for out in outputs):
                showed = _caller()  # no backward collective will show it: the split itself
                note("split", misused[id(group)], root or showed, showed)
        return result

    namespaces = (dist, dist.distributed_c10d)
    saved = [(ns, op, getattr(ns, op)) for ns in namespaces for op in COLLECTIVES if hasattr(ns, op)]
    wrapped = {id(original): probed(op, original) for _, op, original in saved}
    from megatron.core import parallel_state as ps
    from megatron.core import utils

    defaults = {id(getattr(utils, name)): defaulted(getattr(utils, name)) for name in GROUP_DEFAULTS}
    getters = {id(f): getter(f) for name, f in vars(ps).items()
               if name.startswith("get_") and "group" in name and callable(f)}
    swaps = {**wrapped, **defaults, **getters}
    patches = [(ns, op, wrapped[id(original)]) for ns, op, original in saved]
    patches += [(module, name, swaps[id(value)]) for module, name, value in _aliases(swaps)]
    patches.append((torch.autograd.Function, "apply", classmethod(applied)))
    try:
        with patched_attrs(patches):
            yield found
    finally:
        nodes.clear()
        reads.clear()
        if _uses:
            _uses[-1].extend(found)


def _use(op: str, hit: tuple[str, tuple[int, ...], tuple[int, ...]], root: str, showed: str) -> dict:
    """The violation of one collective on a replaced global group: located at ``root`` (the
    line that chose the group), showing at ``showed`` (the line that issued it)."""
    name, used, meant = hit
    location, _, function = root.partition(" in ")
    line = (f"checker: {location}: {op} on parallel_state's global {name} group {list(used)}, but the "
            f"model's pg_collection.{name} is {list(meant)}")
    if location != showed:
        line += f"; the group chosen in {function}, the {'split' if op == 'split' else 'collective'} issued at {showed}"
    return {"rule": RULE, "location": location, "op": op, "group": name, "function": function,
            "showed": showed, "line": line}


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
