"""What a scenario sees: its layout, rank, process groups, mesh, and helpers to shard global tensors.

A scenario is a module-level function ``scenario(ctx) -> dict[str, Tensor]`` written once for
every layout. It builds global tensors (seeded identically on every rank), takes its local
pieces with :meth:`ScenarioContext.shard`, runs its model on ``ctx.groups`` and returns named
outputs. :meth:`ScenarioContext.register` lets parity compare module outputs and gradients;
:meth:`ScenarioContext.declare` states an output's placement per axis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property

import torch
import torch.distributed as dist

from shardcheck.parity.layout import BASE_DIMS, GROUP_NAMES, Layout
from shardcheck.typecheck import checker
from shardcheck.typecheck.types import Mesh, Placement, R, Shard, V
from shardcheck.typecheck.types import P as PARTIAL

Types = dict[str, Placement]
Scenario = Callable[["ScenarioContext"], Mapping[str, torch.Tensor]]

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


class ScenarioOutputError(TypeError):
    """A scenario returned something other than a dict of output name -> tensor."""


def scenario_outputs(scenario: Scenario, ctx: ScenarioContext) -> dict[str, torch.Tensor]:
    """Run ``scenario(ctx)``; its outputs, or ScenarioOutputError naming what it returned."""
    outputs = scenario(ctx)
    name = getattr(scenario, "__qualname__", None) or getattr(getattr(scenario, "func", None), "__qualname__", "scenario")
    if not isinstance(outputs, Mapping):
        raise ScenarioOutputError(f"scenario {name} returned a {type(outputs).__name__}, expected a dict "
                                  "of output name -> tensor, e.g. {'loss': loss}")
    for key, value in outputs.items():
        if not isinstance(value, (torch.Tensor, int, float)):
            raise ScenarioOutputError(f"scenario {name}: output {key!r} is a {type(value).__name__}, "
                                      "expected a tensor or a number")
    return dict(outputs)
_current: list[ScenarioContext] = []


def build_groups(layout: Layout, rank: int) -> dict[str, dist.ProcessGroup]:
    """This rank's process group for every group name of ``layout`` (cached by ranks).

    Every rank of the default world must call this with the same layout, members or not:
    groups are created in the same order everywhere, as torch.distributed requires. So a
    layout may use the first ranks of a larger world, as the warm pool does.
    """
    mine: dict[str, dist.ProcessGroup] = {}
    for name in GROUP_NAMES:
        for ranks in layout.partition(name):
            if ranks not in _GROUPS:
                _GROUPS[ranks] = dist.new_group(list(ranks))
            if rank in ranks:
                mine[name] = _GROUPS[ranks]
    return mine


class ScenarioContext:
    """One rank's view of a scenario run under a layout."""

    def __init__(self, layout: Layout, rank: int, groups: Mapping[str, dist.ProcessGroup],
                 device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.rank = rank
        self.groups = dict(groups)
        self.device = torch.device(device)
        self.models: list[tuple[str, torch.nn.Module]] = []
        self.module_types: dict[str, Types] = {}
        self.module_outputs: list[tuple[str, torch.Tensor]] | None = None  # recorded when a list
        self._declared: dict[int, tuple[torch.Tensor, Types]] = {}
        self._by_storage: dict[tuple[int, tuple[int, ...]], Types] = {}
        self.perturbation = 0.0
        self._noise = torch.Generator()

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @cached_property
    def mesh(self) -> Mesh:
        """A checker mesh over the base axes tp, cp, dp, pp."""
        return Mesh(rank=self.rank, **{dim: self.groups[dim] for dim in BASE_DIMS})

    def index(self, axis: str) -> int:
        """This rank's position in its group on ``axis``."""
        return self.layout.group_ranks(axis, self.rank).index(self.rank)

    def register(self, model: torch.nn.Module, prefix: str = "",
                 types: Mapping[str, Mapping[str, Placement]] | None = None) -> torch.nn.Module:
        """Let parity compare this model's module outputs and parameter gradients.

        ``types`` optionally gives module output placements by module name, e.g.
        ``{"fc1": {"tp": sc.S(-1)}}``; undeclared ones come from the checker or are inferred.
        """
        self.models.append((prefix, model))
        for name, placements in (types or {}).items():
            self.module_types[_join(prefix, name)] = dict(placements)
        for name, module in model.named_modules():
            module.register_forward_hook(self._recorder(_join(prefix, name) or type(model).__name__))
        for param in model.parameters():  # nn.Parameter(ctx.shard(...)) is a new tensor to the checker
            _annotate(param, self.declared_types(param) or {})
        return model

    def _recorder(self, name: str):
        def record(module, inputs, output):
            if self.module_outputs is not None and isinstance(output, torch.Tensor):
                self.module_outputs.append((name, output.detach().clone()))
        return record

    def declare(self, tensor: torch.Tensor, **types: Placement) -> torch.Tensor:
        """State ``tensor``'s placement per axis (e.g. ``tp=sc.S(-1), dp=sc.V``); returns it."""
        self._declared[id(tensor)] = (tensor, dict(types))
        self._by_storage[_storage_key(tensor)] = dict(types)
        return tensor

    def declared_types(self, tensor: torch.Tensor) -> Types | None:
        """The placements declared for this tensor, or for one with its storage and shape
        (so ``nn.Parameter(ctx.shard(...))`` keeps the shard's placement)."""
        entry = self._declared.get(id(tensor))
        if entry is not None and entry[0] is tensor:
            return entry[1]
        return self._by_storage.get(_storage_key(tensor))

    def shard(self, global_tensor: torch.Tensor, placement: Placement, axis: str) -> torch.Tensor:
        """This rank's local piece of ``global_tensor`` laid out as ``placement`` on ``axis``.

        S(d): the rank's chunk along d; R or I: a copy; P: the value on the axis' first rank and
        zeros elsewhere. The piece is moved to ``ctx.device`` and declared (and annotated for an
        active type checker) with that placement on ``axis`` and R, or the placements declared
        for ``global_tensor``, on the other axes.
        """
        value = self._perturbed(global_tensor.detach())
        size, index = len(self.layout.group_ranks(axis, self.rank)), self.index(axis)
        if isinstance(placement, Shard):
            if value.shape[placement.dim] % size:
                raise ValueError(f"dim {placement.dim} of shape {tuple(value.shape)} does not "
                                 f"split evenly over {axis}={size}")
            local = value.chunk(size, placement.dim)[index]
        elif placement is PARTIAL:
            local = value if index == 0 else torch.zeros_like(value)
        elif placement is V:
            raise ValueError("V has no global value to shard; shard the batch with S(0) instead")
        else:
            local = value
        local = local.contiguous().clone().to(self.device)
        local.requires_grad_(global_tensor.requires_grad)
        placements = {**(self.declared_types(global_tensor) or dict.fromkeys(BASE_DIMS, R)), axis: placement}
        _annotate(local, placements)
        return self.declare(local, **placements)

    def perturb_inputs(self, epsilons: float, seed: int) -> None:
        """Make :meth:`shard` perturb each global tensor by up to ``epsilons`` machine epsilons
        (relative, uniform random from ``seed``); 0 turns it off. Parity's noise runs use it."""
        self.perturbation = epsilons
        self._noise.manual_seed(seed)

    def _perturbed(self, value: torch.Tensor) -> torch.Tensor:
        if not self.perturbation or not value.is_floating_point():
            return value
        relative = self.perturbation * torch.finfo(value.dtype).eps
        noise = torch.rand(value.shape, generator=self._noise, dtype=torch.float64) * 2 - 1
        return (value.double() * (1 + relative * noise)).to(value.dtype)


def _annotate(tensor: torch.Tensor, placements: Mapping[str, Placement]) -> None:
    """Tell an active type checker the placements of a tensor the scenario just sharded."""
    active_checker = checker.current()
    if active_checker is not None:
        checker.annotate(tensor, **{a: p for a, p in placements.items() if a in active_checker.names})


def _storage_key(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return tensor.data_ptr(), tuple(tensor.shape)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


@contextmanager
def active(ctx: ScenarioContext) -> Iterator[ScenarioContext]:
    """Make ``ctx`` the context that :func:`shard` and :func:`current_context` use."""
    _current.append(ctx)
    try:
        yield ctx
    finally:
        _current.pop()


def current_context() -> ScenarioContext:
    """The context of the scenario running on this rank."""
    if not _current:
        raise RuntimeError("no scenario is running on this rank")
    return _current[-1]


def shard(global_tensor: torch.Tensor, placement: Placement, axis: str) -> torch.Tensor:
    """``current_context().shard(...)``: the local piece of a global tensor on ``axis``."""
    return current_context().shard(global_tensor, placement, axis)


def replicate(global_tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a global tensor used whole by every rank (declared R on every axis)."""
    return current_context().shard(global_tensor, R, "tp")
