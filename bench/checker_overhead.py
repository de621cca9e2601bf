"""Time added per intercepted op by the SPMD type checker, against eager and spmd_types 0.3.1.

Workloads: (a) 200 mul/add ops, (b) a matmul/mul/add/relu mix of 200 ops, on 256x256
float32 tensors, one thread, medians of repeated runs. spmd_types runs in a subprocess with
bench/.deps (``make bench`` installs it there) on sys.path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from _workloads import OPS, WORKLOADS, interleaved, tensors  # noqa: E402

import shardcheck as sc  # noqa: E402

HERE = Path(__file__).parent
DEPS = HERE / ".deps"
GOAL_US = 10.0
FLOOR = "bare TorchDispatchMode (floor)"


class _BareMode(TorchDispatchMode):
    """The floor: a dispatch mode that only calls the op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _configs(workload) -> dict:
    """Each run's (context, function): eager, a bare mode, shardcheck untyped and typed."""
    t = tensors()
    mesh = sc.Mesh(rank=0, tp=[0, 1], dp=[0, 2])
    with sc.typecheck(mesh):
        typed = {name: sc.annotate(value.clone(), tp=sc.R, dp=sc.V) for name, value in t.items()}
    return {
        "eager": lambda: (nullcontext(), lambda: workload(t)),
        FLOOR: lambda: (_BareMode(), lambda: workload(t)),
        "shardcheck, untyped inputs": lambda: (sc.typecheck(mesh), lambda: workload(t)),
        "shardcheck, typed (tp=R, dp=V)": lambda: (sc.typecheck(mesh), lambda: workload(typed)),
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


def main() -> None:
    torch.set_num_threads(1)
    other = _spmd_types()
    table = Table(title=f"SPMD checker overhead ({OPS} ops, 256x256 fp32, 1 thread, median CPU time)")
    for column in ("workload", "run", "us/op", "added us/op", "over floor", "vs eager"):
        table.add_column(column, justify="left" if column in ("workload", "run") else "right")
    for name, workload in WORKLOADS.items():
        seconds = interleaved(_configs(workload))
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


if __name__ == "__main__":
    main()
