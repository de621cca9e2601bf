"""One Megatron GPT training step on warm Gloo ranks, with and without the type checker.

Used by checker_overhead.py. Each rank builds the GPT once, then takes blocks of unchecked,
checked, audit and floor steps in turn (forward, backward and ``finalize_model_grads`` through
Megatron's schedule, then the optimizer step); a checked step runs inside the audit's checked
region (:func:`shardcheck.megatron.checks.typecheck.checked_region`), entered once per step, an
audit step in it as the audit enters it (op calls also counted by source location), a floor step under a dispatch mode that only calls each op (the cost of any Python dispatch mode).
Steps run in blocks of consecutive steps of one kind, each block timed whole: what a checked
step leaves for later (its garbage, collected during a following step) is billed to checking,
not to whichever step comes next (single alternating steps moved up to a quarter of a step
between kinds). Blocks are timed in CPU time of the rank's process (its Gloo threads included)
and in wall time: on a shared machine a rank waits for a core, and the other rank for it,
which wall time counts. One more step, untimed, counts the ops a dispatch mode intercepts, so
that the checker's cost is also given per op call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

LAYOUT = "tp2-sp"
# The audit's tiny GPT, and three with more work per op (the checker's cost is per op call); all
# have 2 layers, micro-batch 2 and 2 microbatches. The last is the smallest of real GPTs' width
# (hidden 1024 and up); their sequences are longer still, so their ratio lies below its row's.
SIZES = {"audit GPT (hidden 32, seq 16)": {},
         "GPT hidden 256, seq 128": {"hidden": 256, "heads": 8, "seq": 128, "vocab": 1024},
         "GPT hidden 512, seq 256": {"hidden": 512, "heads": 8, "seq": 256, "vocab": 2048},
         "GPT hidden 1024, seq 512": {"hidden": 1024, "heads": 16, "seq": 512, "vocab": 4096}}


def step_seconds(ctx: Any, sizes: dict[str, int], rounds: int, block: int) -> dict[str, Any]:
    """On each rank: (CPU, wall) seconds of an unchecked, a checked, an audit and a floor step, each the
    median over ``rounds`` of a block of ``block`` consecutive steps of that kind, and under
    ``"ops"`` the op calls a dispatch mode intercepts in one step."""
    from _workloads import BareMode, CountingMode

    from shardcheck.megatron.checks.typecheck import checked_region
    from shardcheck.megatron.cpu.parallel import megatron_parallel
    from shardcheck.megatron.scenarios.gpt import GPTSetup, build_training

    with megatron_parallel(ctx) as pg:
        training = build_training(ctx, GPTSetup(**sizes), pg)
        regions = {"unchecked": nullcontext, "checked": lambda: checked_region(ctx),
                   "audit": lambda: checked_region(ctx, {}), "floor": BareMode}
        for region in regions.values():  # warm-up: first-call costs of each
            _timed(training, region, 1)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in regions}
        for _ in range(rounds):
            for name, region in regions.items():
                times[name].append(_timed(training, region, block))
        counter = CountingMode()
        _timed(training, lambda: counter, 1)
    result: dict[str, Any] = {name: tuple(statistics.median(sample[i] for sample in samples) for i in (0, 1))
                              for name, samples in times.items()}
    result["ops"] = counter.ops
    return result


def _timed(training: Any, region: Callable[[], AbstractContextManager], steps: int) -> tuple[float, float]:
    """(CPU, wall) seconds per step of ``steps`` consecutive steps, each in a new ``region()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        with region():
            training.forward_backward()
            training.optimizer.step()
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps
