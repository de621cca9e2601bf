"""What each rank runs for the audit: one component with its options, recorded and checked.

:func:`run_case` runs a catalogue component inside the contracts' recorder, the corrected
functions asked for, the type checker (optionally) and a few guards that keep a warm rank
usable for hundreds of cases.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import torch

from shardcheck.megatron.audit.sweep import setup_kwargs
from shardcheck.megatron.checks import contracts, explicit, piece_gradients
from shardcheck.megatron.checks.typecheck import checked_region
from shardcheck.parity.op_record import recording_ops
from shardcheck.patching import patched, patched_attrs
from shardcheck.typecheck import checker as typecheck_checker


@dataclass(frozen=True)
class CaseResult:
    """What one rank's run of a case sends back to the parent (through the rank pool's pipe)."""

    outputs: dict[str, torch.Tensor]  # named outputs, as float64 copies
    calls: list  # the contracted calls, in order (:mod:`shardcheck.megatron.checks.contracts`)
    violations: list[dict]  # explicit-group misuses, then the type checker's violations
    ops: dict | None = None  # type-checked: op calls in megatron-core, typed and unknown
    entry: str | None = None  # ``file:line`` of the first megatron-core forward it ran
    reads: tuple[str, ...] = ()  # the config fields read (:func:`config_reads`), sorted
    # where megatron-core declared each parameter's tensor parallelism, by global key
    # (:func:`~shardcheck.megatron.scenarios.reference.parameter_declarations`)
    declared: dict[str, str] = field(default_factory=dict)
    # with ``record_ops``: megatron-core's op calls and their outputs (:mod:`shardcheck.parity.op_record`)
    op_calls: list = field(default_factory=list)
    # with a ``UNIFORM`` fix: per global key filled with one value, where its layout is made
    # (:func:`~shardcheck.megatron.scenarios.reference.uniform_weights`)
    owners: dict[str, str | None] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a rank's pipe, a share's file) with each output that float32 holds exactly
        sent as float32: most are float64 copies of a float32 model's values (half the bytes)."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["outputs"] = {name: _narrowed(value) for name, value in self.outputs.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["outputs"] = {name: value.double() for name, value in state["outputs"].items()}
        for name, value in state.items():
            object.__setattr__(self, name, value)

    @cached_property
    def digest(self) -> str:
        """A hash of the outputs (names, shapes and values)."""
        h = hashlib.sha1()
        for name in sorted(self.outputs):
            value = self.outputs[name].contiguous()
            h.update(f"{name}{tuple(value.shape)}".encode())
            h.update(value.numpy().tobytes())
        return h.hexdigest()[:16]


def _narrowed(value: torch.Tensor) -> torch.Tensor:
    """``value`` as float32 when that holds it exactly, else as it is."""
    narrow = value.float()
    return narrow if value.dtype == torch.float64 and torch.equal(narrow.double(), value) else value


# ---- on each rank --------------------------------------------------------------------------

# a fix that fills a global key's weights with one value: ``UNIFORM + key`` (:mod:`param_layouts`)
UNIFORM = "uniform weights of "

def run_case(ctx: Any, component: str, options: tuple, fixes: tuple[str, ...], typecheck: bool,
             rng_offset: int = 0, record_ops: bool = False) -> CaseResult:
    """Run one component with its options on this rank; outputs, contracted calls, violations,
    and (type-checked) the op calls megatron-core made, typed and unknown.

    ``rng_offset`` shifts the seed of Megatron's model-parallel RNG (screening for randomness).
    ``record_ops`` records every op megatron-core calls, with its outputs and (type-checked) their
    types and the number of contracted calls made before each, from the first megatron-core
    forward on (building and initialising the model differ by design), to narrow a divergence
    to its first op
    (:func:`~shardcheck.megatron.audit.divergence.first_op_gap`).
    Collectives issued on a global group that the layout's explicit groups replace are
    violations too (:mod:`shardcheck.megatron.checks.explicit`); the fix ``explicit.FIX`` reruns with
    the global groups pointed at the explicit ones.
    """
    from shardcheck.megatron.scenarios import COMPONENTS, scenario
    from shardcheck.megatron.scenarios.reference import parameter_declarations, uniform_weights

    warnings.filterwarnings("ignore")
    _quiet_worker()
    contracts.install()
    run = scenario(component, **setup_kwargs(COMPONENTS[component].setup, options))
    with ExitStack() as stack:
        stack.enter_context(_fresh_moe_state())
        stack.enter_context(_seed_shifted(rng_offset))
        entries = stack.enter_context(_entry_points())
        calls = stack.enter_context(contracts.recording())
        owners = stack.enter_context(uniform_weights(tuple(f.removeprefix(UNIFORM) for f in fixes
                                                           if f.startswith(UNIFORM))))
        stack.enter_context(contracts.fixed(tuple(f for f in fixes if f != explicit.FIX
                                                   and not f.startswith((UNIFORM, piece_gradients.PREFIX)))))
        stack.enter_context(explicit.routed(explicit.FIX in fixes))
        stack.enter_context(piece_gradients.reduced(ctx.groups, tuple(
            f for f in fixes if f.startswith(piece_gradients.PREFIX))))
        misuses = stack.enter_context(explicit.recording())
        ops: dict = {}
        found = stack.enter_context(checked_region(ctx, ops) if typecheck else nullcontext([]))
        reads = stack.enter_context(config_reads())
        declared = stack.enter_context(parameter_declarations())
        op_calls = stack.enter_context(recording_ops(_megatron_core(), lambda: len(calls), lambda: bool(entries), _PROBES)
                                       if record_ops else nullcontext([]))
        outputs = run(ctx)
        filled = dict(owners)
    return CaseResult({k: torch.as_tensor(v).detach().double().clone() for k, v in outputs.items()},
                      calls, [*misuses, *found], ops or None, entries[0] if entries else None,
                      tuple(sorted(reads)), declared, op_calls, filled)


# the ops of the probes, the checker and the scenarios' harness (copying a result to record it,
# typing a returned count) are not megatron-core's; shardcheck's CPU stand-ins for its kernels are
_PROBES = tuple(os.path.dirname(module.__file__) + os.sep for module in (contracts, typecheck_checker))
_PROBES += (os.path.join(os.path.dirname(os.path.dirname(contracts.__file__)), "scenarios") + os.sep,)


def _megatron_core() -> str:
    """The directory of the megatron-core this rank runs, with a trailing separator."""
    import megatron.core

    return os.path.dirname(megatron.core.__file__) + os.sep


def _config_classes() -> list[type]:
    """ModelParallelConfig and every config class derived from it that is loaded."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    found, todo = [], [ModelParallelConfig]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return found


@contextmanager
def config_reads() -> Iterator[set[str]]:
    """The config fields (of ModelParallelConfig and its subclasses, TransformerConfig first)
    read inside the block, outside any config's own construction (``__post_init__`` reads every
    field to validate it; what it derives from a field shows in the built config instead).

    A field never read under a layout cannot change a run under that layout: the run with
    another value follows the same path. The audit prunes such options
    (:meth:`shardcheck.megatron.audit.runner.Runner.not_read`).
    """
    read: set[str] = set()
    building = [0]
    classes = _config_classes()
    base = classes[0]

    def recording(self: Any, name: str) -> Any:
        if not building[0] and name in type(self).__dataclass_fields__:
            read.add(name)
        return object.__getattribute__(self, name)

    def counted(post_init: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            building[0] += 1
            try:
                return post_init(self, *args, **kwargs)
            finally:
                building[0] -= 1
        return wrapper

    counting = [(cls, "__post_init__", counted(cls.__dict__["__post_init__"]))
                for cls in classes if "__post_init__" in cls.__dict__]
    with patched_attrs([*counting, (base, "__getattribute__", recording)]):
        yield read


def _quiet_worker() -> None:
    """Send this rank's own stdout/stderr (Megatron's prints, Gloo's C++ messages when a
    pool restarts) to /dev/null; results and tracebacks go back to the parent by pipe."""
    import os

    if getattr(_quiet_worker, "done", False) or os.environ.get("SHARDCHECK_AUDIT_VERBOSE"):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    _quiet_worker.done = True  # type: ignore[attr-defined]


@contextmanager
def _entry_points() -> Iterator[list[str]]:
    """Record the forward of the first megatron-core module the scenario runs (its entry point),
    past the wrappers that hand the batch to the model they hold (DDP, ``Float16Module``: a
    ``module`` attribute), whose forward is where every bug of the model would show."""
    import inspect

    from shardcheck.megatron.checks.paths import megatron_path

    found: list[str] = []

    def record(module: torch.nn.Module, _args: Any) -> None:
        cls = type(module)
        wrapper = isinstance(getattr(module, "module", None), torch.nn.Module)
        if not found and not wrapper and cls.__module__.startswith("megatron.core"):
            forward = inspect.unwrap(cls.forward)
            found.append(f"{megatron_path(inspect.getsourcefile(forward))}:{inspect.getsourcelines(forward)[1]}")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield found
    finally:
        handle.remove()


@contextmanager
def _fresh_moe_state() -> Iterator[None]:
    """Start and leave each case with the MoE globals a fresh process has: the aux-loss
    gradient scale (set by the schedules, read by every later router backward) and the
    aux-loss logging tracker."""
    from megatron.core.transformer.moe import moe_utils

    def reset() -> None:
        moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
        moe_utils.get_moe_layer_wise_logging_tracker().clear()

    reset()
    try:
        yield
    finally:
        reset()


@contextmanager
def _seed_shifted(offset: int) -> Iterator[None]:
    from megatron.core.tensor_parallel import random as megatron_random

    original = megatron_random.model_parallel_cuda_manual_seed

    def shifted(seed: int, *args: Any, **kwargs: Any) -> Any:
        return original(seed + offset, *args, **kwargs)

    with patched(megatron_random, "model_parallel_cuda_manual_seed", shifted):
        yield
