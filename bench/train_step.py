"""``shardcheck train``'s cost: start-up time and time per training step on 1, 2 and 4 CPU ranks.

Each layout runs Megatron's own ``pretrain`` (a 2-layer GPT, hidden 64, sequence 32) through
``shardcheck train``'s launcher for a few steps. The time per step is the median of the
recorded ``train_step`` times after the first; start-up is the wall time less all steps.
Ratios are against the one-rank run of the same invocation.
"""

from __future__ import annotations

import statistics
import time

from rich.console import Console
from rich.table import Table

from shardcheck.cli.train import Launch, run_training
from shardcheck.megatron.train.args import plan_runs

STEPS = 6
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--lr", "1e-3", "--vocab-size", "1024"]
LAYOUTS = {1: [], 2: ["--tensor-model-parallel-size", "2"], 4: ["--tensor-model-parallel-size", "2"]}


def measure(nproc: int) -> tuple[float, float]:
    """(start-up seconds, median seconds per step after the first) of one run on ``nproc`` ranks."""
    plan = plan_runs(MODEL + LAYOUTS[nproc], nproc, STEPS)
    args = plan.reference if nproc == 1 else plan.parallel
    start = time.perf_counter()
    run = run_training(args, nproc, Launch(cpu=True, megatron=None, entry=None, timeout=900), f"{nproc} ranks")
    wall = time.perf_counter() - start
    seconds = [s.metrics["iteration-time"] or 0.0 for s in run.steps]
    return wall - sum(seconds), statistics.median(seconds[1:])


def main() -> None:
    table = Table(title=f"shardcheck train: {STEPS} steps of a 2-layer GPT, Megatron pretrain on Gloo CPU ranks")
    for column in ("ranks", "layout", "start-up (s)", "per step (ms)", "start-up vs 1 rank", "step vs 1 rank"):
        table.add_column(column, justify="right")
    base = None
    for nproc in LAYOUTS:
        startup, step = measure(nproc)
        base = base or (startup, step)
        layout = {1: "one rank", 2: "tp2", 4: "tp2 dp2"}[nproc]
        table.add_row(str(nproc), layout, f"{startup:.1f}", f"{step * 1e3:.0f}",
                      f"{startup / base[0]:.2f}x", f"{step / base[1]:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
