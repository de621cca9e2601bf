"""Time added per intercepted op by the SPMD type checker, against eager and spmd_types 0.3.1,
and the cost a user pays: one Megatron GPT training step checked against unchecked.

Workloads: (a) 200 mul/add ops, (b) a matmul/mul/add/relu mix of 200 ops, on 256x256
float32 tensors, one thread, medians of repeated runs. spmd_types runs in a subprocess with
bench/.deps (``make bench`` installs it there) on sys.path. The Megatron step (tp2-sp on two
Gloo ranks, one thread each: forward, backward and optimizer step) takes unchecked, checked
and floor steps in turn in the same run, for four GPT sizes (see _megatron_step.py), and
gives the checker's cost per intercepted op beside the microbenchmark's; ``--megatron-only``
runs just that (and the microbenchmark's typed runs it is compared with), ``--hidden N`` only
the GPT of hidden size N (e.g. ``--megatron-only --hidden 256``, the goal's row).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _megatron_step import LAYOUT, SIZES, step_seconds  # noqa: E402
from _workloads import OPS, WORKLOADS, BareMode, interleaved, tensors  # noqa: E402

import shardcheck as sc  # noqa: E402

HERE = Path(__file__).parent
DEPS = HERE / ".deps"
GOAL_US = 10.0
STEP_GOAL = 1.3  # a checked Megatron step costs at most this times an unchecked one
ROUNDS, BLOCK = 3, 3  # per kind of step: the median of 3 blocks of 3 consecutive steps
PRELOAD = ("megatron.core.models.gpt.gpt_model", "megatron.core.optimizer",
           "megatron.core.pipeline_parallel.schedules")
FLOOR = "bare TorchDispatchMode (floor)"
TYPED = "shardcheck, typed (tp=R, dp=V)"
OP_GOAL = 2.0  # the checker's added time per op call in a Megatron step, at most this times the microbenchmark's


def _configs(workload) -> dict:
    """Each run's (context, function): eager, a bare mode, shardcheck untyped and typed."""
    t = tensors()
    mesh = sc.Mesh(rank=0, tp=[0, 1], dp=[0, 2])
    with sc.typecheck(mesh):
        typed = {name: sc.annotate(value.clone(), tp=sc.R, dp=sc.V) for name, value in t.items()}
    return {
        "eager": lambda: (nullcontext(), lambda: workload(t)),
        FLOOR: lambda: (BareMode(), lambda: workload(t)),
        "shardcheck, untyped inputs": lambda: (sc.typecheck(mesh), lambda: workload(t)),
        TYPED: lambda: (sc.typecheck(mesh), lambda: workload(typed)),
    }


def _spmd_types() -> dict | str:
    if not (DEPS / "spmd_types").is_dir():
        return "not installed (make bench installs spmd-types==0.3.1 into bench/.deps)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEPS), env_path()]))
    proc = subprocess.run([sys.executable, str(HERE / "_spmd_types_runner.py")],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")


def _row(table: Table, name: str, label: str, seconds: float, eager: float,
         floor: float) -> None:
    added, over_floor = (seconds - eager) / OPS * 1e6, (seconds - floor) / OPS * 1e6
    table.add_row(name, label, f"{seconds / OPS * 1e6:.1f}", f"{added:+.1f}",
                  f"{over_floor:+.1f}", f"{seconds / eager:.2f}x")


def microbenchmark(configs: tuple[str, ...] | None = None) -> dict[str, dict[str, float]]:
    """Median CPU seconds of each workload's runs (``configs``: only those runs)."""
    torch.set_num_threads(1)
    runs = {}
    for name, workload in WORKLOADS.items():
        made = _configs(workload)
        runs[name] = interleaved({c: made[c] for c in configs or made})
    return runs


def micro_added_us(runs: dict[str, dict[str, float]]) -> float:
    """The typed microbenchmark's added µs per op over eager, the mean of its workloads."""
    return statistics.mean((r[TYPED] - r["eager"]) / OPS * 1e6 for r in runs.values())


def _hidden(sizes: dict[str, int]) -> int:
    """A GPT's hidden size (the audit GPT's is GPTSetup's default, 32)."""
    return sizes.get("hidden", 32)


def megatron_step(micro_us: float, hidden: int | None = None) -> None:
    """Print the checked / unchecked time of one Megatron GPT training step, per model size (or
    only the one of ``hidden`` size), and the checker's added µs per intercepted op against
    ``micro_us`` (the microbenchmark's)."""
    from shardcheck.parity.layout import Layout
    from shardcheck.parity.pool import RankPool

    layout = Layout.parse(LAYOUT)
    table = Table(title=f"Megatron GPT training step, {LAYOUT} on {layout.world_size} Gloo ranks "
                        f"(forward, backward, optimizer step; median of {ROUNDS} blocks of {BLOCK} steps, slower rank)")
    for column in ("model", "unchecked CPU ms", "checked CPU ms", "checked / unchecked",
                   "audit / unchecked", "floor / unchecked", "wall: checked / unchecked", "ops", "added us/op",
                   "over floor", "vs micro"):
        table.add_column(column, justify="left" if column == "model" else "right")
    with RankPool(layout.world_size, timeout=900, preload=PRELOAD) as pool:
        for name, sizes in SIZES.items():
            if hidden is not None and _hidden(sizes) != hidden:
                continue
            ranks = pool.run(layout, step_seconds, sizes, ROUNDS, BLOCK)
            (plain, plain_wall), (checked, checked_wall), (audit, _), (floor, _) = (
                tuple(max(r[key][i] for r in ranks) for i in (0, 1))
                for key in ("unchecked", "checked", "audit", "floor"))
            ops = max(r["ops"] for r in ranks)
            added = (checked - plain) / ops * 1e6
            table.add_row(name, f"{plain * 1e3:.0f}", f"{checked * 1e3:.0f}", f"{checked / plain:.2f}x",
                          f"{audit / plain:.2f}x", f"{floor / plain:.2f}x", f"{checked_wall / plain_wall:.2f}x", str(ops),
                          f"{added:+.1f}", f"{(checked - floor) / ops * 1e6:+.1f}",
                          f"{added / micro_us:.1f}x")
    Console(width=180).print(table)
    print(f"goal: a checked step costs at most {STEP_GOAL}x an unchecked one in CPU time (the "
          "checker's cost is per op call, so the ratio falls as the work per op grows; 'floor' "
          "runs the step under a dispatch mode that only calls each op; 'audit' checks it as "
          "the audit does, also counting op calls by source location; wall time counts the "
          "waits for a core on a shared machine). 'ops': op calls a dispatch mode intercepts in "
          "one step (slower rank); 'added us/op': (checked - unchecked) CPU time / ops, 'over "
          "floor': (checked - floor) / ops; 'vs micro': added us/op over the typed "
          f"microbenchmark's mean added us/op ({micro_us:.1f} in this run), goal at most "
          f"{OP_GOAL:.0f}x.")


def main() -> None:
    argv = sys.argv[1:]
    hidden = int(argv[argv.index("--hidden") + 1]) if "--hidden" in argv else None
    if hidden is not None and hidden not in map(_hidden, SIZES.values()):
        sys.exit(f"--hidden: one of {sorted(map(_hidden, SIZES.values()))}")
    if "--megatron-only" in argv:
        megatron_step(micro_added_us(microbenchmark(("eager", TYPED))), hidden)
        return
    other = _spmd_types()
    table = Table(title=f"SPMD checker overhead ({OPS} ops, 256x256 fp32, 1 thread, median CPU time)")
    for column in ("workload", "run", "us/op", "added us/op", "over floor", "vs eager"):
        table.add_column(column, justify="left" if column in ("workload", "run") else "right")
    runs = microbenchmark()
    for name, seconds in runs.items():
        eager, floor = seconds["eager"], seconds[FLOOR]
        for label, value in seconds.items():
            _row(table, name, label, value, eager, floor)
        if isinstance(other, dict):
            _row(table, name, f"spmd_types {other['version']}", other[name], eager, floor)
    Console(width=120).print(table)
    if not isinstance(other, dict):
        print(f"spmd_types: {other}")
    print(f"goal: at most {GOAL_US:.0f} us added per op. 'over floor' is the time added beyond a "
          "dispatch mode that only calls the op, i.e. the checker's own work. spmd_types runs "
          "in strict mode with every input annotated R on a 2-rank fake group "
          "(its own subprocess, same workloads); it is a TorchFunctionMode.")
    megatron_step(micro_added_us(runs), hidden)


if __name__ == "__main__":
    main()
