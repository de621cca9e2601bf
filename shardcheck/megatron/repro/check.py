"""The ``checker:`` line of an audit repro script: its run under the type checker, as in the audit.

A script imports this only when shardcheck is installed (the import is guarded). The run is
type-checked with Megatron's typing and contracts (:func:`shardcheck.megatron.checks.typecheck.checked_region`)
on the process groups the script built with ``initialize_model_parallel``, the script itself
being harness code (violations are located in megatron-core, past its frames); the line
returned is the violation the audit recorded, when the checker raises it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

AXES = ("tp", "cp", "dp", "pp", "ep")


def model_groups(pg: Any) -> SimpleNamespace:
    """A context for :func:`checked_region` over the groups the script's model is given."""
    import torch.distributed as dist

    return SimpleNamespace(rank=dist.get_rank(), groups={axis: getattr(pg, axis) for axis in AXES})


def checked_run(run: Callable[[Any, Any], Any], sizes: Any, pg: Any, recorded: str) -> tuple[Any, str | None]:
    """``run(sizes, pg)`` under the checker (and the probe of collectives on parallel_state's
    global groups where ``pg`` differs from them): its result, and ``recorded`` if the checker
    raised that violation again (same rule and location), else None."""
    from shardcheck.megatron.checks import contracts, explicit
    from shardcheck.megatron.checks.typecheck import checked_region, layout_mesh
    from shardcheck.typecheck.locations import harness_code

    ctx = model_groups(pg)
    with contracts.probes_installed(), checked_region(ctx) as found, explicit.global_group_uses(pg) as misused, \
            harness_code(run.__code__.co_filename), _script_inputs_typed(run.__globals__, layout_mesh(ctx).names):
        result = run(sizes, pg)
    again = any(_rule_and_place(v["line"]) == _rule_and_place(recorded) for v in [*found, *misused])
    return result, (recorded if _on_any_rank(again) else None)


def _on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank (a violation may be raised on one rank only)."""
    import torch
    import torch.distributed as dist

    raised = torch.tensor([float(flag)])
    dist.all_reduce(raised, op=dist.ReduceOp.MAX)
    return bool(raised.item())


@contextmanager
def _script_inputs_typed(namespace: dict[str, Any], axes: tuple[str, ...]) -> Iterator[None]:
    """Type what the script makes: ``seeded`` global tensors are R, ``shard`` gives S(0) over tp
    under sequence parallelism, and its batch cut for CP is the region's typed cut."""
    from megatron.core import utils

    import shardcheck as sc
    from shardcheck.typecheck.types import R, S

    saved = {name: namespace[name] for name in ("seeded", "shard", "get_batch_on_this_cp_rank")
             if name in namespace}
    if "seeded" in saved:
        namespace["seeded"] = lambda key, *shape: sc.annotate(saved["seeded"](key, *shape),
                                                              **dict.fromkeys(axes, R))
    if "shard" in saved and "tp" in axes:
        namespace["shard"] = lambda tensor, sizes, group: (
            sc.annotate(saved["shard"](tensor, sizes, group), tp=S(0)) if sizes["sp"]
            else saved["shard"](tensor, sizes, group))
    if "get_batch_on_this_cp_rank" in saved:
        namespace["get_batch_on_this_cp_rank"] = utils.get_batch_on_this_cp_rank
    try:
        yield
    finally:
        namespace.update(saved)


def _rule_and_place(line: str) -> str:
    """``checker: RULE at FILE:LINE`` of a checker line (the types after it may differ)."""
    return line.removeprefix("checker: ").split(" in ", 1)[0]
