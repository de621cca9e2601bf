"""The microbenchmark workloads shared by checker_overhead.py and its spmd_types runner."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SIZE, OPS, REPEATS = 256, 200, 25


class BareMode(TorchDispatchMode):
    """The floor: a dispatch mode that only calls the op. Like the checker, it opts out of the
    Dynamo-disabling wrapper torch puts around every subclass's ``__torch_dispatch__`` (3 to 4
    µs an op), so 'over floor' is the checker's own work."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class CountingMode(BareMode):
    """The floor's mode, counting the op calls it intercepts (untimed: the count costs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(SIZE, SIZE, generator=gen) / SIZE**0.5 for name in "xabw"}


def mul_add(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """(a) 200 ops: alternating mul and add."""
    x = t["x"]
    for _ in range(OPS // 2):
        x = x * t["a"]
        x = x + t["b"]
    return x


def mixed(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """(b) 200 ops: matmul, mul, add, relu."""
    x = t["x"]
    for _ in range(OPS // 4):
        x = torch.relu(torch.matmul(x, t["w"]) * t["a"] + t["b"])
    return x


WORKLOADS: dict[str, Callable] = {"200 mul/add": mul_add, "matmul/mul/add/relu": mixed}


def median_seconds(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median CPU time of ``fn`` over ``repeats`` runs, after one warm-up run."""
    return interleaved({"fn": lambda: (nullcontext(), fn)}, repeats)["fn"]


def interleaved(configs: dict[str, Callable[[], tuple]], repeats: int = REPEATS) -> dict[str, float]:
    """Median CPU seconds per config, sampling the configs in turn so that drift hits all.

    CPU time of this thread, not wall time: the machine is shared, and time spent waiting
    for a core is not the checker's. Each config returns (context manager, function): the
    function is timed inside it.
    """
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(repeats + 1):
        for name, make in configs.items():
            context, fn = make()
            with context:
                start = time.thread_time()
                fn()
                elapsed = time.thread_time() - start
            if round_:  # the first round warms up
                samples[name].append(elapsed)
    return {name: statistics.median(times) for name, times in samples.items()}
