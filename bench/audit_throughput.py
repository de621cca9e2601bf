"""The audit's throughput: where one case's time goes, per component; cases per second on warm
Gloo ranks; and the plan's size with and without pruning (options whose config fields the
component's default run never read there).

The profile runs each component's defaults under each layout on warm ranks and splits one case
into: the one-rank reference (run on its own, as the audit caches it; wall time only), the
construction on the ranks (from the first Megatron module built to the first Megatron module's
forward: the model, DDP, its weights, the optimizer), the rest of the checked run, the
type checker's share of it (the same case unchecked, subtracted), the results' transport back
to the parent (its wall time less the slowest rank's: building the layout's Gloo groups, pickling
the results, reading the collective logs; no CPU time), and the judgement against the reference.
Wall and CPU seconds are the mean over the component's layouts, taken on the slowest rank.
Then it runs the defaults tier of the plan and a sample of the option cases that pruning
keeps, both measured in this run; the plan sizes come from the same read sets. Last, the whole
plan's size over every layout before pruning: the default plan's selection and ``--full``.

    python bench/audit_throughput.py                    # every component, the two-rank layouts
    python bench/audit_throughput.py --only gpt --layouts tp2,cp2 --sample 10
    python bench/audit_throughput.py --only gdn,mamba --with seq=4   # a smaller setup, same run
"""

from __future__ import annotations

import argparse
import pickle
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.table import Table

PHASES = ("reference", "construction", "checked run", "of which checker", "dispatch + transport", "judgement")


@contextmanager
def _clocked(totals: dict[str, float], name: str):
    """Add the block's wall and CPU seconds to ``totals[name]`` and ``totals[name + ' cpu']``."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        totals[name] += time.perf_counter() - wall
        totals[f"{name} cpu"] += time.process_time() - cpu


def timed_case(ctx: Any, component: str, options: tuple, typecheck: bool) -> tuple[Any, dict[str, float]]:
    """On each rank: the audit's run of the component with ``options``, its construction timed from
    the first Megatron module built to the first Megatron module's forward (the model, DDP,
    the weights and the optimizer)."""
    import torch
    from megatron.core.transformer.module import MegatronModule

    from shardcheck.megatron.audit.rank import run_case
    from shardcheck.patching import patched

    marks: dict[str, tuple[float, float]] = {}
    build = MegatronModule.__init__

    def first_built(self: Any, *args: Any, **kwargs: Any) -> None:
        marks.setdefault("built", (time.perf_counter(), time.process_time()))
        build(self, *args, **kwargs)

    def first_forward(module: torch.nn.Module, _args: Any) -> None:
        if type(module).__module__.startswith("megatron."):
            marks.setdefault("forward", (time.perf_counter(), time.process_time()))

    totals: dict[str, float] = defaultdict(float)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)
    try:
        with patched(MegatronModule, "__init__", first_built), _clocked(totals, "run"):
            result = run_case(ctx, component, options, (), typecheck)
    finally:
        hook.remove()
    if {"built", "forward"} <= marks.keys():
        totals["construction"] = marks["forward"][0] - marks["built"][0]
        totals["construction cpu"] = marks["forward"][1] - marks["built"][1]
    totals["payload"] = len(pickle.dumps(result))
    return result, dict(totals)


def profile(runner: Any, cases: list[Any]) -> dict[str, dict[str, float]]:
    """Each component's (with options: ``component (options)``) mean seconds per phase (wall, and
    CPU as ``<phase> cpu``) over its cases."""
    from shardcheck.parity.pool import PoolFailure

    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[str, int] = defaultdict(int)
    for case in cases:
        got = sums[_row(case)]
        started = time.perf_counter()
        ref = runner.reference(case.component, case.options)  # a one-rank run on the pools: its wall time
        got["reference"] += time.perf_counter() - started
        if isinstance(ref, str):
            continue
        try:
            unchecked = [t for _, t in runner.pools.run(case.layout, timed_case, case.component, case.options,
                                                         False)]
            started = time.perf_counter()
            ranks = runner.pools.run(case.layout, timed_case, case.component, case.options, True)
        except PoolFailure:  # a layout the component's scenario refuses when it runs (gdn under pp)
            continue
        parent_wall = time.perf_counter() - started
        slowest = max((t for _, t in ranks), key=lambda t: t["run"])
        for name in ("construction", "construction cpu", "payload"):
            got[name] += slowest.get(name, 0.0)
        got["checked run"] += slowest["run"] - slowest.get("construction", 0.0)
        got["checked run cpu"] += slowest["run cpu"] - slowest.get("construction cpu", 0.0)
        plain = max(unchecked, key=lambda t: t["run"])
        got["of which checker"] += max(slowest["run"] - plain["run"], 0.0)
        got["of which checker cpu"] += max(slowest["run cpu"] - plain["run cpu"], 0.0)
        got["dispatch + transport"] += max(parent_wall - slowest["run"], 0.0)
        with _clocked(got, "judgement"):
            runner.judge(case, [result for result, _ in ranks], ref)
        counts[_row(case)] += 1
    return {name: {k: v / counts[name] for k, v in got.items()} for name, got in sums.items() if counts[name]}


def _row(case: Any) -> str:
    options = ", ".join(f"{k}={v}" for k, v in case.options)
    return f"{case.component} ({options})" if options else case.component


def profile_table(means: dict[str, dict[str, float]], layouts: int) -> Table:
    table = Table(title=f"one case's time, mean over {layouts} layout(s): wall s (CPU s) on the slowest rank")
    table.add_column("component")
    for phase in PHASES:
        table.add_column(phase, justify="right")
    table.add_column("results KB", justify="right")
    for name, got in means.items():
        table.add_row(name, *(f"{got[p]:.2f}" + (f" ({got[p + ' cpu']:.2f})" if p + " cpu" in got else "")
                              for p in PHASES), f"{got['payload'] / 1024:.0f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated components (default: all)")
    parser.add_argument("--layouts", default=None, help="comma-separated layouts (default: every two-rank one)")
    parser.add_argument("--sample", type=int, default=20, help="option cases to time after the defaults")
    parser.add_argument("--with", dest="variants", action="append", default=[], metavar="NAME=VALUE",
                        help="also profile each component with this setup field (e.g. seq=4), in the same "
                             "run, each case right after its defaults' (repeatable: one variant each)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    from shardcheck.megatron.audit.rank import CaseResult
    from shardcheck.megatron.audit.runner import Runner, pools
    from shardcheck.megatron.audit.schedule import in_default_plan
    from shardcheck.megatron.audit.sweep import Case, components_plan, layouts, parse_value
    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.parity.layout import Layout

    names = args.only.split(",") if args.only else list(COMPONENTS)
    chosen = ([Layout.parse(t) for t in args.layouts.split(",")] if args.layouts
              else [lay for lay in layouts(max_world=2, explicit=True)])
    cases = [c for c in components_plan(names, chosen)
             if COMPONENTS[c.component].refuses(c.layout) is None]
    defaults = [c for c in cases if not c.options]
    with pools() as warm:
        variants = [((name, parse_value(value)),) for name, _, value in (v.partition("=") for v in args.variants)]
        means = profile(Runner(warm, typecheck=True),
                        [v for c in defaults for v in [c, *(Case(c.component, o, c.layout) for o in variants)]])
        runner = Runner(warm, typecheck=True)  # the profile's references stay cached in the pools
        started = time.monotonic()
        ran = [runner.run(c) for c in defaults if isinstance(runner.reference(c.component, ()), CaseResult)]
        defaults_seconds = time.monotonic() - started
        options = [c for c in cases if c.options]
        kept = [c for c in options if runner.not_read(c) is None]
        sample = [c for c in kept if runner.screen(c.component, c.options) is None][:args.sample]
        started = time.monotonic()
        for case in sample:
            runner.run(case)
        sample_seconds = time.monotonic() - started

    console = Console(width=160)
    console.print(profile_table(means, len(chosen)))
    rate = len(ran) / defaults_seconds if defaults_seconds else 0.0
    sample_rate = len(sample) / sample_seconds if sample_seconds else 0.0
    table = Table(title=f"audit throughput: {len(names)} component(s), {len(chosen)} layout(s)")
    for column in ("measure", "value"):
        table.add_column(column)
    table.add_row("defaults tier: cases/s (one-rank references cached by the profile)",
                  f"{rate:.2f} ({len(ran)} cases)")
    table.add_row("option cases: cases/s (screened, references cached)",
                  f"{sample_rate:.2f} ({len(sample)} cases)")
    table.add_row("plan size without pruning (cases)", str(len(cases)))
    table.add_row("plan size with pruning (cases)", f"{len(defaults) + len(kept)}")
    table.add_row("pruned: cases whose options the defaults never read",
                  f"{len(options) - len(kept)} ({100 * (len(options) - len(kept)) / max(len(options), 1):.0f}% "
                  "of the option cases)")
    whole = components_plan(names, layouts(explicit=True))
    table.add_row("whole plan over every layout, before pruning: default plan / --full (cases)",
                  f"{sum(map(in_default_plan, whole))} / {len(whole)}")
    console.print(table)


if __name__ == "__main__":
    main()
