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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import shardcheck as sc  # noqa: E402
from shardcheck.launch import spawn_ranks  # noqa: E402
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


def _median_step_s(x, params, group) -> float:
    times = []
    for _ in range(REPEATS):
        dist.barrier(group)
        start = time.perf_counter()
        for _ in range(STEPS):
            _step(x, params, group)
        times.append((time.perf_counter() - start) / STEPS)
    return statistics.median(times)


def _rank_bench() -> tuple[float, float]:
    torch.set_num_threads(1)
    group = dist.group.WORLD
    params = _mlp_params(group)
    x = torch.randn(TOKENS, HIDDEN)
    _step(x, params, group)  # warm up
    plain = _median_step_s(x, params, group)
    with sc.typecheck(sc.Mesh(tp=group)):
        for w1, w2 in params:
            sc.annotate(w1, tp=sc.S(0))
            sc.annotate(w2, tp=sc.S(1))
        sc.annotate(x, tp=sc.R)
        checked = _median_step_s(x, params, group)
    return plain, checked


def main() -> int:
    plain, checked = spawn_ranks(_rank_bench, 2, timeout=600)[0]
    ratio = checked / plain
    print(f"4-layer TP=2 MLP forward+backward, {TOKENS}x{HIDDEN}, ffn {FFN}, 1 thread per rank")
    print(f"{'plain eager':>22}: {plain * 1e3:8.2f} ms/step")
    print(f"{'with the checker':>22}: {checked * 1e3:8.2f} ms/step")
    print(f"{'ratio':>22}: {ratio:8.2f}x  (goal <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
