"""The audit's throughput: cases per second on warm Gloo ranks, and the plan's size with and
without pruning (options whose config fields the component's default run never read there).

It runs the defaults tier of the plan (every component's defaults under each layout: the runs
that record which config fields each component reads), then a sample of the option cases
pruning keeps, both measured in this run; the plan sizes come from the same read sets.

    python bench/audit_throughput.py                    # every component, the two-rank layouts
    python bench/audit_throughput.py --only gpt --layouts tp2,cp2 --sample 10
"""

from __future__ import annotations

import argparse
import time
import warnings

from rich.console import Console
from rich.table import Table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated components (default: all)")
    parser.add_argument("--layouts", default=None, help="comma-separated layouts (default: every two-rank one)")
    parser.add_argument("--sample", type=int, default=20, help="option cases to time after the defaults")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    from shardcheck.megatron.audit.runner import Runner, pools
    from shardcheck.megatron.audit.sweep import components_plan, layouts
    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.parity.layout import Layout

    names = args.only.split(",") if args.only else list(COMPONENTS)
    chosen = ([Layout.parse(t) for t in args.layouts.split(",")] if args.layouts
              else [lay for lay in layouts(max_world=2, explicit=True)])
    cases = [c for c in components_plan(names, chosen)
             if COMPONENTS[c.component].refuses(c.layout) is None]
    defaults = [c for c in cases if not c.options]
    with pools() as warm:
        runner = Runner(warm, typecheck=True)
        started = time.monotonic()
        ran = [runner.run(c) for c in defaults if isinstance(runner.reference(c.component, ()), dict)]
        defaults_seconds = time.monotonic() - started
        options = [c for c in cases if c.options]
        kept = [c for c in options if runner.not_read(c) is None]
        sample = [c for c in kept if runner.screen(c.component, c.options) is None][:args.sample]
        started = time.monotonic()
        for case in sample:
            runner.run(case)
        sample_seconds = time.monotonic() - started

    rate = len(ran) / defaults_seconds if defaults_seconds else 0.0
    sample_rate = len(sample) / sample_seconds if sample_seconds else 0.0
    table = Table(title=f"audit throughput: {len(names)} component(s), {len(chosen)} layout(s)")
    for column in ("measure", "value"):
        table.add_column(column)
    table.add_row("defaults tier: cases/s (incl. one-rank references)", f"{rate:.2f} ({len(ran)} cases)")
    table.add_row("option cases: cases/s (screened, references cached)",
                  f"{sample_rate:.2f} ({len(sample)} cases)")
    table.add_row("plan size without pruning (cases)", str(len(cases)))
    table.add_row("plan size with pruning (cases)", f"{len(defaults) + len(kept)}")
    table.add_row("pruned: cases whose options the defaults never read",
                  f"{len(options) - len(kept)} ({100 * (len(options) - len(kept)) / max(len(options), 1):.0f}% "
                  "of the option cases)")
    Console().print(table)


if __name__ == "__main__":
    main()
