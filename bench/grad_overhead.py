"""Forward + backward of a 4-layer TP=2 MLP on two Gloo ranks, with and without the checker.

Prints the median step time of each and their ratio (goal: at most 1.5x). One thread per rank.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import shardcheck as sc  # noqa: E402
from shardcheck.parity.launch import spawn_ranks  # noqa: E402
from tests.grad_programs import CopyToRegion, ReduceFromRegion  # noqa: E402

LAYERS, TOKENS, HIDDEN, FFN = 4, 128, 256, 1024
STEPS, REPEATS = 5, 7


def _mlp_params(group) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tp = dist.get_world_size(group)
    torch.manual_seed(0)
    return [(torch.randn(FFN // tp, HIDDEN, requires_grad=True),
             torch.randn(HIDDEN, FFN // tp, requires_grad=True)) for _ in range(LAYERS)]


def _step(x: torch.Tensor, params, group) -> None:
    h = x
    for w1, w2 in params:
        h = torch.relu(CopyToRegion.apply(h, group) @ w1.t()) @ w2.t()
        h = ReduceFromRegion.apply(h, group)
    h.pow(2).mean().backward()


def _step_s(x, params, group) -> float:
    start = time.perf_counter()
    for _ in range(STEPS):
        _step(x, params, group)
    return (time.perf_counter() - start) / STEPS


def _rank_bench() -> tuple[float, float]:
    """Median step times, plain and checked, measured in alternation so load drift hits both."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    dist.barrier(group)
    params = _mlp_params(group)
    named = {f"layers.{i}.fc{j + 1}.weight": w for i, pair in enumerate(params)
             for j, w in enumerate(pair)}
    x = torch.randn(TOKENS, HIDDEN)
    mesh = sc.Mesh(tp=group)
    plain, checked = [], []
    for repeat in range(REPEATS + 1):
        plain_s = _step_s(x, params, group)
        with sc.typecheck(mesh):
            sc.annotate_parameters(named, {"*.fc1.weight": {"tp": sc.S(0)},
                                           "*.fc2.weight": {"tp": sc.S(1)}})
            sc.annotate(x, tp=sc.R)
            checked_s = _step_s(x, params, group)
        if repeat:  # the first round warms up
            plain.append(plain_s)
            checked.append(checked_s)
    return statistics.median(plain), statistics.median(checked)


def _fake_group_bench() -> tuple[float, float]:
    """The same on rank 0 of a fake 2-rank group: one process, collectives typed, no data moved."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        return _rank_bench()
    finally:
        dist.destroy_process_group()


def main() -> int:
    rows = {
        "2 Gloo ranks": spawn_ranks(_rank_bench, 2, timeout=600)[0],
        "1 process, fake group": _fake_group_bench(),
    }
    print(f"4-layer TP=2 MLP forward+backward, {TOKENS}x{HIDDEN}, ffn {FFN}, 1 thread per rank, "
          f"median of {REPEATS} rounds of {STEPS} steps")
    print(f"{'':>24} {'plain ms':>9} {'checked ms':>11} {'ratio':>7}")
    for name, (plain, checked) in rows.items():
        print(f"{name:>24} {plain * 1e3:9.2f} {checked * 1e3:11.2f} {checked / plain:6.2f}x")
    print("goal: ratio <= 1.5x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
