"""The type checker against numeric truth: generated SPMD programs on real Gloo ranks.

Each program (shardcheck.fuzz.oracle_gen) runs on 2 or 4 warm ranks under the checker and once on
one rank; the oracle judges the checker's verdict by the numbers (shardcheck.fuzz.oracle). Prints
programs generated, right and wrong counts, false alarms, misses, undecided and programs per
second. Goal: 0 false alarms and 0 misses over at least 10,000 programs (fixed seed).

    python bench/checker_oracle.py [--programs 10000] [--seed 0] [--save disagreements.txt]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings

import torch
from hypothesis import HealthCheck, given, seed, settings
from rich.console import Console
from rich.table import Table

from shardcheck.fuzz.oracle import check
from shardcheck.fuzz.oracle_gen import programs
from shardcheck.parity.pool import RankPool


def run(count: int, at_seed: int, progress: bool = True) -> tuple[collections.Counter, list, float]:
    outcomes: collections.Counter = collections.Counter()
    disagreements = []
    with RankPool(4) as pool:
        @seed(at_seed)
        @settings(max_examples=count, database=None, deadline=None, phases=["generate"],
                  suppress_health_check=list(HealthCheck))
        @given(programs(valid_only=True))
        def judge(program):
            verdict = check(pool, program)
            outcomes[verdict.outcome] += 1
            done = sum(outcomes.values())
            if progress and done % 500 == 0:
                print(f"{done} programs: {dict(outcomes)}", file=sys.stderr, flush=True)
            if not verdict.agrees:
                disagreements.append((program, verdict))

        start = time.perf_counter()
        judge()
        elapsed = time.perf_counter() - start
    return outcomes, disagreements, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write each disagreeing program and its verdict here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # tiny tensors: threads only contend
    outcomes, disagreements, elapsed = run(args.programs, args.seed)
    total = sum(outcomes.values())
    table = Table(title=f"checker vs numbers: {total} generated programs, seed {args.seed}")
    for column in ("programs", "right", "wrong", "false alarms", "misses", "undecided", "errors", "programs/s"):
        table.add_column(column, justify="right")
    table.add_row(str(total), str(outcomes["right"]), str(outcomes["wrong"]), str(outcomes["false alarm"]),
                  str(outcomes["miss"]), str(outcomes["undecided"]), str(outcomes["error"]),
                  f"{total / elapsed:.1f}")
    Console().print(table)
    for program, verdict in disagreements[:20]:
        print(f"{verdict.outcome}: {verdict.why}\n  {program!r}")
    if args.save:
        with open(args.save, "w") as out:
            for program, verdict in disagreements:
                out.write(f"# {verdict.outcome}: {verdict.why}\n{program!r}\n")
    return 1 if disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
