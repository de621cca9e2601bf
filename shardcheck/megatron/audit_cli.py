"""The ``shardcheck audit`` command: the type checker and parity over the sweep of megatron-core."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import click

from shardcheck.cli_errors import EXIT_FOUND, InputError

DEFAULT_TIME_LIMIT_MIN = 12.0


def _layouts(text: str | None):
    from shardcheck.layout import Layout, LayoutError
    from shardcheck.megatron.sweep import layouts

    if not text:
        return layouts(explicit=True)
    try:
        return [Layout.parse(part) for part in text.split(",") if part.strip()]
    except LayoutError as exc:
        raise click.BadParameter(str(exc), param_hint="--layouts") from None


def _fixed_options(component_names: list[str], pairs: tuple[str, ...]) -> tuple:
    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.megatron.sweep import parse_value, setup_kwargs

    options = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--set")
        options.append((name.strip(), parse_value(value)))
    for component in component_names:
        try:
            COMPONENTS[component].setup(**setup_kwargs(COMPONENTS[component].setup, options))
        except (KeyError, TypeError) as exc:
            raise click.BadParameter(f"{component}: {exc}", param_hint="--set") from None
    return tuple(options)


def _plan(only: tuple[str, ...], layouts_text: str | None, sets: tuple[str, ...], budget: int | None):
    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.megatron.sweep import Case, component_options, plan, runs_under

    unknown = [c for c in only if c not in COMPONENTS]
    if unknown:
        raise click.BadParameter(f"unknown component(s) {unknown}; known: {sorted(COMPONENTS)}",
                                 param_hint="--only")
    names = list(only or COMPONENTS)
    layout_list = _layouts(layouts_text)
    if sets:
        options = _fixed_options(names, sets)
        return [Case(c, options, layout) for layout in layout_list for c in names
                if runs_under(c, layout)]
    return plan({c: component_options(c) for c in names}, layout_list, None)


@click.command("audit")
@click.option("--budget", type=click.IntRange(1), default=None,
              help="Run at most N multi-rank cases (instead of a time limit).")
@click.option("--time-limit", "time_limit", type=click.FloatRange(min=0.1), default=None,
              help=f"Stop starting cases after MIN minutes (default {DEFAULT_TIME_LIMIT_MIN:g}).")
@click.option("--only", multiple=True, metavar="COMPONENT", help="Audit only these components (repeatable).")
@click.option("--layouts", "layouts_text", default=None, metavar="LIST",
              help="Comma-separated layouts, e.g. tp2,tp2-sp,cp2; tp2-dp2@dp-tp gives the model "
                   "explicit groups of another rank order (default: every grid up to 4 ranks).")
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE",
              help="Run exactly these options (repeatable) instead of sweeping; used by reproduce commands.")
@click.option("--out", "out_dir", default="audit-out", show_default=True, type=click.Path(file_okay=False),
              help="Where report.md and findings.json go.")
@click.option("--json", "as_json", is_flag=True, help="Print findings.json to stdout instead of the summary.")
@click.option("--no-typecheck", is_flag=True, help="Parity only, without the type checker.")
@click.option("--root", default=".shardcheck", show_default=True, type=click.Path(file_okay=False),
              help="The findings store shared with fuzz, repro and findings.")
def audit_command(budget: int | None, time_limit: float | None, only: tuple[str, ...],
                  layouts_text: str | None, sets: tuple[str, ...], out_dir: str, as_json: bool,
                  no_typecheck: bool, root: str) -> None:
    """Audit megatron-core: run its components over the generic sweep of options and layouts
    on Gloo ranks, compare each with one rank, type-check it, and report deduplicated findings.

    Each confirmed finding gets a torchrun script in OUT/repro/ and every finding is kept in
    the store at ROOT, for `shardcheck repro` and `shardcheck findings`. Exit status: 1 when
    there are findings, 2 when no case ran (the console says why) or on bad input."""
    if budget is not None and time_limit is not None:
        raise InputError("give --budget or --time-limit, not both")
    warnings.filterwarnings("ignore", category=UserWarning)  # Megatron's "Apex is not installed"
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise InputError("megatron-core is not installed: pip install 'shardcheck[megatron]'") from None
    from shardcheck.megatron import audit_report
    from shardcheck.megatron.audit import audit
    from shardcheck.megatron.audit_repro import save_with_scripts

    started = time.monotonic()
    cases = _plan(only, layouts_text, sets, budget)
    limit = None if budget is not None or sets else 60 * (time_limit or DEFAULT_TIME_LIMIT_MIN)
    if time_limit is not None:
        limit = 60 * time_limit
    with _progress(len(cases) if budget is None else min(budget, len(cases)), as_json) as show:
        result = audit(cases, budget=budget, time_limit=limit, typecheck=not no_typecheck, progress=show)
    summary = result.summary()
    save_with_scripts(result.findings, Path(out_dir), root)
    summary["wall time (s)"] = round(time.monotonic() - started, 1)
    audit_report.write(Path(out_dir), result.findings, summary)
    if as_json:
        click.echo((Path(out_dir) / "findings.json").read_text())
    else:
        _print_summary(result, summary, Path(out_dir))
    if not summary["cases run"]:
        raise InputError(_nothing_ran(summary, len(cases)))
    if result.findings:
        sys.exit(EXIT_FOUND)


def _nothing_ran(summary: dict, planned: int) -> str:
    """Why an audit ran no case: what refused, skipped or broke the cases asked for."""
    reasons = summary["not_applicable"] + summary["not_swept"] + summary["errors"]
    if not planned:
        reasons = reasons or ["no component runs under the layouts given"]
    return "no case ran: " + "; ".join(reasons or ["every case was screened out"])


class _progress:
    """A rich progress bar on stderr, advanced once per case started."""

    def __init__(self, total: int, quiet: bool) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(TextColumn("audit"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.description}"), console=Console(stderr=True),
                            disable=quiet, transient=True)
        self.task = self.bar.add_task("", total=total)

    def __enter__(self):
        self.bar.start()

        def show(case, done: int) -> None:
            self.bar.update(self.task, completed=done, description=case.label[:70])
        return show

    def __exit__(self, *exc_info: object) -> None:
        self.bar.stop()


def _print_summary(result, summary: dict, out_dir: Path) -> None:
    from rich.console import Console

    from shardcheck.megatron.audit_report import script_line, show_number

    console = Console(highlight=False, soft_wrap=True)
    console.print(f"audit: {summary['cases run']} cases run, {summary['cases failed to run']} failed to run, "
                  f"{summary['options not swept']} options not swept, {summary['wall time (s)']} s"
                  + (" (stopped at the limit)" if result.stopped_early else ""))
    confirmed = [f for f in result.findings if f.kind != "type-only"]
    typed_only = [f for f in result.findings if f.kind == "type-only"]
    console.print(f"{len(confirmed)} finding(s) confirmed by parity, {len(typed_only)} type-only")
    for n, f in enumerate(confirmed, 1):
        options = ", ".join(f"{k}={v}" for k, v in f.trigger["options"].items()) or "defaults"
        console.print(f"[{n}] {f.id} {f.kind}  {f.location}\n    {f.title}\n"
                      f"    trigger: {f.trigger['component']} @ {f.trigger['layout']} ({options})")
        for e in f.effect[:2]:
            console.print(f"    effect: {e['value']}: observed {show_number(e['observed'])} vs reference "
                          f"{show_number(e['reference'])}, max abs err {e['max_abs_error']:.3g}")
        if f.checker:
            console.print(f"    {f.checker}")
        if f.corrected:
            console.print(f"    corrected control: {f.corrected['result']}")
        console.print(f"    reproduce: {f.reproduce}\n    script: {script_line(f)}")
    for n, f in enumerate(typed_only, len(confirmed) + 1):
        console.print(f"[{n}] {f.id} type-only  {f.checker}  ({f.trigger['component']} @ "
                      f"{f.trigger['layout']} {f.trigger['options'] or ''})")
    console.print(f"report: {out_dir / 'report.md'}, {out_dir / 'findings.json'}")
    sys.stdout.flush()
