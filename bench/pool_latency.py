"""Wall time of one scenario (a 2-layer TP=2 MLP): through the warm rank pool vs. a fresh torchrun.

Both are measured in the same run; the ratio is the point (goal: the pool at least 30x faster).
Under torchrun this file is the script each rank runs: it executes the scenario in place.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import shardcheck as sc
from shardcheck.parity.pool import RankPool, in_torchrun, run_in_place

POOL_RUNS, TORCHRUN_RUNS = 30, 3


def mlp(ctx: sc.ScenarioContext) -> dict[str, torch.Tensor]:
    """Column-parallel then row-parallel linear layers on ctx.groups['tp']."""
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(32, 64), torch.randn(256, 64), torch.randn(64, 256)
    hidden = F.gelu(F.linear(sc.replicate(x), ctx.shard(w1, sc.S(0), "tp")))
    out = F.linear(hidden, ctx.shard(w2, sc.S(1), "tp"))
    dist.all_reduce(out, group=ctx.groups["tp"])
    return {"out": out}


def time_pool() -> list[float]:
    with RankPool(2, checker=False) as pool:
        pool.run("tp2", mlp)  # warm-up: groups created once
        times = []
        for _ in range(POOL_RUNS):
            start = time.perf_counter()
            pool.run("tp2", mlp)
            times.append(time.perf_counter() - start)
    return times


def time_torchrun() -> list[float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__]
    times = []
    for _ in range(TORCHRUN_RUNS):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    pool, torchrun = statistics.median(time_pool()), statistics.median(time_torchrun())
    table = Table(title="one 2-layer TP=2 MLP scenario, wall time per run (median)")
    table.add_column("launch")
    table.add_column("runs", justify="right")
    table.add_column("seconds", justify="right")
    table.add_row("warm rank pool", str(POOL_RUNS), f"{pool:.4f}")
    table.add_row("torchrun each time", str(TORCHRUN_RUNS), f"{torchrun:.2f}")
    Console().print(table)
    print(f"pool speed-up: {torchrun / pool:.0f}x (goal >= 30x)")


if __name__ == "__main__":
    if in_torchrun():
        run_in_place("tp2", mlp)
        dist.destroy_process_group()
    else:
        main()
