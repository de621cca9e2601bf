"""The ``shardcheck audit`` command: the type checker and parity over the sweep of megatron-core."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import click

from shardcheck.cli.errors import EXIT_FOUND, InputError, input_errors, writable_folder
from shardcheck.fuzz.findings import StoreError

DEFAULT_TIME_LIMIT_MIN = 12.0


def _layouts(text: str | None):
    from shardcheck.megatron.audit.sweep import layouts
    from shardcheck.parity.layout import Layout, LayoutError

    if not text:
        return layouts(explicit=True)
    try:
        return [Layout.parse(part) for part in text.split(",") if part.strip()]
    except LayoutError as exc:
        raise click.BadParameter(str(exc), param_hint="--layouts") from None


def _fixed_options(component_names: list[str], pairs: tuple[str, ...]) -> tuple:
    """The ``--set`` options, each checked against the field it sets in every component audited
    before any case runs, with its value as the field takes it (an Enum member from its name)."""
    from shardcheck.megatron.audit.fixed_options import OptionError, value_from_text

    parsed = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--set")
        parsed.append((name.strip(), value))
    try:
        options = [tuple((n, value_from_text(c, n, v)) for n, v in parsed) for c in component_names]
    except OptionError as exc:
        raise click.BadParameter(str(exc), param_hint="--set") from None
    return options[0]


def _plan(only: tuple[str, ...], layouts_text: str | None, sets: tuple[str, ...], budget: int | None):
    """The cases to run, and the options left out because their config does not build."""
    from shardcheck.megatron.audit.sweep import Case, runs_under, sweep_plan
    from shardcheck.megatron.scenarios import COMPONENTS

    unknown = [c for c in only if c not in COMPONENTS]
    if unknown:
        raise click.BadParameter(f"unknown component(s) {unknown}; known: {sorted(COMPONENTS)}",
                                 param_hint="--only")
    names = list(only or COMPONENTS)
    layout_list = _layouts(layouts_text)
    if sets:
        options = _fixed_options(names, sets)
        return [Case(c, options, layout) for layout in layout_list for c in names
                if runs_under(c, layout)], {}
    return sweep_plan(names, layout_list)


@click.group("audit", invoke_without_command=True)
@click.option("--budget", type=click.IntRange(1), default=None,
              help="Run at most N multi-rank cases (instead of a time limit).")
@click.option("--time-limit", "time_limit", type=click.FloatRange(min=0.1), default=None,
              help=f"Stop starting cases after MIN minutes (default {DEFAULT_TIME_LIMIT_MIN:g}).")
@click.option("--only", multiple=True, metavar="COMPONENT", help="Audit only these components (repeatable).")
@click.option("--layouts", "layouts_text", default=None, metavar="LIST",
              help="Comma-separated layouts, e.g. tp2,tp2-sp,cp2; tp2-dp2@dp-tp gives the model "
                   "explicit groups of another rank order (default: every grid up to 4 ranks).")
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE",
              help=("Run exactly these options (repeatable) instead of sweeping; used by reproduce commands. "
                    "impl=te runs gpt, moe, mtp, gdn or mamba on Transformer Engine."))
@click.option("--full", is_flag=True,
              help="Run the whole plan: every option set under every layout, without a time limit "
                   "unless --time-limit is given. The default plan runs every component's defaults "
                   "under every layout and each option under one layout per parallel dimension "
                   "(and an explicit-group one), and counts the rest as left to --full "
                   "(docs/audit.md); --layouts or --set runs every case asked for.")
@click.option("--out", "out_dir", default="audit-out", show_default=True, type=click.Path(file_okay=False),
              help="Where report.md and findings.json go.")
@click.option("--json", "as_json", is_flag=True, help="Print findings.json to stdout instead of the summary.")
@click.option("--no-typecheck", is_flag=True, help="Parity only, without the type checker.")
@click.option("--megatron", "megatron_path", default=None, metavar="PATH",
              help="Audit the megatron-core under PATH (a Megatron-LM checkout or any folder holding "
                   "megatron/core) instead of the one `import megatron.core` finds.")
@click.option("--root", default=".shardcheck", show_default=True, type=click.Path(file_okay=False),
              help="The findings store shared with fuzz, repro and findings.")
@click.option("--shard", "shard_text", default=None, metavar="K/N",
              help="Run the K-th of N deterministic shares of the plan (every share runs the "
                   "defaults); `shardcheck audit merge DIR...` joins the shares' --out folders.")
@click.pass_context
@input_errors(StoreError)
def audit_command(ctx: click.Context, budget: int | None, time_limit: float | None, only: tuple[str, ...],
                  layouts_text: str | None, sets: tuple[str, ...], full: bool, out_dir: str, as_json: bool,
                  no_typecheck: bool, megatron_path: str | None, root: str, shard_text: str | None) -> None:
    """Audit megatron-core: run its components over the generic sweep of options and layouts
    on Gloo ranks, compare each with one rank, type-check it, and report deduplicated findings.

    Each confirmed finding gets a torchrun script in OUT/repro/ and every finding is kept in
    the store at ROOT, for `shardcheck repro` and `shardcheck findings`. Exit status: 1 when
    there are findings, 2 when no case ran (the console says why) or on bad input."""
    if ctx.invoked_subcommand is not None:
        return
    if budget is not None and time_limit is not None:
        raise InputError("give --budget or --time-limit, not both")
    share = _share(shard_text)
    warnings.filterwarnings("ignore", category=UserWarning)  # Megatron's "Apex is not installed"
    source = _audited(megatron_path)
    from shardcheck.megatron.audit.run import audit

    started = time.monotonic()
    cases, unbuilt = _plan(only, layouts_text, sets, budget)
    if share is not None:
        from shardcheck.megatron.audit.shards import shard

        cases = shard(cases, *share)
    _check_writable(out_dir, root)
    limit = None if budget is not None or sets or full else 60 * DEFAULT_TIME_LIMIT_MIN
    if time_limit is not None:
        limit = 60 * time_limit
    whole = full or bool(sets) or layouts_text is not None  # else the default plan's selection
    with _progress(len(cases) if budget is None else min(budget, len(cases)), as_json) as show:
        result = audit(cases, budget=budget, time_limit=limit, typecheck=not no_typecheck, progress=show,
                       unbuilt=unbuilt, full=whole)
    if share is not None:
        from shardcheck.megatron.audit.shards import save_share

        save_share(result, *share, Path(out_dir))
    _finish(result, started, out_dir, root, source, as_json, planned=len(cases),
            rest=_rest_command(only, megatron_path))


def _rest_command(only: tuple[str, ...], megatron_path: str | None) -> str:
    """The command that runs the cases this audit's default plan left to --full (and the rest)."""
    scope = "".join(f" --only {c}" for c in only) + (f" --megatron {megatron_path}" if megatron_path else "")
    return f"shardcheck audit --full{scope}"


def _share(text: str | None) -> tuple[int, int] | None:
    from shardcheck.megatron.audit.shards import ShareError, parse_shard

    try:
        return None if text is None else parse_shard(text)
    except ShareError as exc:
        raise InputError(f"--shard: {exc}") from None


@audit_command.command("merge")
@click.argument("dirs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--out", "out_dir", default="audit-out", show_default=True, type=click.Path(file_okay=False),
              help="Where the merged report.md and findings.json go.")
@click.option("--json", "as_json", is_flag=True, help="Print findings.json to stdout instead of the summary.")
@click.option("--root", default=".shardcheck", show_default=True, type=click.Path(file_okay=False),
              help="The findings store shared with fuzz, repro and findings.")
@click.option("--megatron", "megatron_path", default=None, metavar="PATH",
              help="The megatron-core the shares audited, when not the installed one.")
@input_errors(StoreError)
def merge_command(dirs: tuple[str, ...], out_dir: str, as_json: bool, root: str,
                  megatron_path: str | None) -> None:
    """Join the --out folders of `shardcheck audit --shard K/N` (all N shares) into the report
    and findings one run of the whole plan gives (each finding's corrected control is rerun)."""
    from shardcheck.megatron.audit.run import merge_shares
    from shardcheck.megatron.audit.shards import ShareError, load_shares

    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        load_shares(list(dirs))
    except ShareError as exc:
        raise InputError(str(exc)) from None
    source = _audited(megatron_path)
    _check_writable(out_dir, root)
    started = time.monotonic()
    _finish(merge_shares(dirs), started, out_dir, root, source, as_json)


def _check_writable(out_dir: str, root: str) -> None:
    """Refuse, before any case runs, an --out folder or a store the audit cannot write."""
    writable_folder(out_dir)
    writable_folder(Path(root) / "findings")


def _finish(result, started: float, out_dir: str, root: str, source, as_json: bool,
            planned: int | None = None, rest: str = "shardcheck audit --full") -> None:
    """Scripts, store, report and summary of an audit result; ``rest`` is the command that
    runs what the default plan left to --full."""
    from shardcheck.megatron.audit import report as audit_report
    from shardcheck.megatron.repro.scripts import save_with_scripts

    summary = result.summary()
    if result.left_to_full:
        summary["run the cases left to --full"] = (
            f"{rest} --out audit-full; in N shares: {rest} --shard K/N --out share-K for K = 1..N, "
            "then shardcheck audit merge share-1 ... share-N --out audit-full")
    save_with_scripts(result.findings, Path(out_dir), root, source)
    summary["wall time (s)"] = round(time.monotonic() - started, 1)
    audit_report.write(Path(out_dir), result.findings, summary, source)
    if as_json:
        click.echo((Path(out_dir) / "findings.json").read_text())
    else:
        _print_summary(result, summary, Path(out_dir), source)
    if not summary["cases run"] and not result.findings:  # a one-rank crash is a finding
        raise InputError(_nothing_ran(summary, planned))
    if result.findings:
        sys.exit(EXIT_FOUND)


def _nothing_ran(summary: dict, planned: int | None) -> str:
    """Why an audit ran no case: what refused, skipped or broke the cases asked for."""
    reasons = summary["not_applicable"] + summary["not_swept"] + summary["errors"]
    if planned == 0:
        reasons = reasons or ["no component runs under the layouts given"]
    return "no case ran: " + "; ".join(reasons or ["every case was screened out"])


def _audited(megatron_path: str | None):
    """The megatron-core to audit (``--megatron`` tree or the installed one), imported here so
    that the forked ranks run it; one line and exit 2 when there is none."""
    from shardcheck.megatron.cpu.source import SourceError, describe, use_tree

    try:
        if megatron_path is not None:
            use_tree(megatron_path)
        import megatron.core  # noqa: F401
    except SourceError as exc:
        raise InputError(str(exc)) from None
    except ImportError as exc:
        where = f"under {megatron_path}" if megatron_path else "installed"
        raise InputError(f"no importable megatron-core {where} ({exc}): "
                         "pip install 'shardcheck[megatron]' or give --megatron PATH") from None
    try:
        import shardcheck.megatron.scenarios  # noqa: F401 - the catalogue imports megatron modules
    except ImportError as exc:
        raise InputError(f"this megatron-core lacks what the catalogue needs: {exc}") from None
    return describe(tree=megatron_path is not None)


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


def _print_summary(result, summary: dict, out_dir: Path, source) -> None:
    from rich.console import Console

    from shardcheck.fuzz.findings import show_number
    from shardcheck.megatron.audit.report import control_line, script_line

    console = Console(highlight=False, soft_wrap=True)
    console.print(f"audited: {source.line()}")
    for component, why in result.unavailable.items():
        console.print(f"cannot run on this version: {component}: {why}")
    console.print(f"audit: {summary['cases run']} cases run, {summary['cases failed to run']} failed to run, "
                  f"{summary['options not swept']} options not swept ({result.not_reached} not reached), "
                  f"{summary['wall time (s)']} s"
                  + (" (stopped at the limit)" if result.stopped_early else ""))
    if result.unreached:
        key = "cases not reached of option sets run elsewhere (budget or time limit)"
        console.print(f"not reached: {summary[key]} cases of {len(result.unreached)} option sets that ran "
                      "under other layouts (report.md lists them under 'Not reached')")
    if result.left_to_full:
        console.print(f"left to --full: {sum(result.left_to_full.values())} cases of "
                      f"{len(result.left_to_full)} option sets outside the default plan; "
                      f"run them: {summary['run the cases left to --full']}")
    confirmed = [f for f in result.findings if f.kind not in ("type-only", "crash")]
    crashes = [f for f in result.findings if f.kind == "crash"]
    typed_only = [f for f in result.findings if f.kind == "type-only"]
    console.print(f"{len(confirmed)} finding(s) confirmed by parity, {len(typed_only)} type-only"
                  + (f", {len(crashes)} crash(es) only a layout causes" if crashes else ""))
    for n, f in enumerate(confirmed, 1):
        options = ", ".join(f"{k}={v}" for k, v in f.config.items()) or "defaults"
        console.print(f"[{n}] {f.id} {f.kind}  {f.location}"
                      + (f"\n    where it showed: {f.showed}" if f.showed else "")
                      + f"\n    {f.title}" + (f"\n    {f.first_op}" if f.first_op else "")
                      + f"\n    trigger: {f.target} @ {f.layout} ({options})")
        for other in f.same_fix:
            also = ", ".join(f"{k}={v}" for k, v in other["options"].items()) or "defaults"
            console.print(f"    trigger: {other['component']} @ {other['layout']} ({also})")
        for e in f.effect[:2]:
            console.print(f"    effect: {e['value']}: observed {show_number(e['observed'])} vs reference "
                          f"{show_number(e['reference'])}, max abs err {e['max_abs_error']:.3g}")
        if f.checker:
            console.print(f"    {f.checker}")
        console.print(f"    corrected control: {control_line(f)}")
        if f.training_args:
            console.print(f"    {f.training_args}")
        console.print(f"    reproduce: {f.reproduce}\n    script: {script_line(f)}")
    for n, f in enumerate(crashes, len(confirmed) + 1):
        console.print(f"[{n}] {f.id} crash  {f.location}\n    {f.title}"
                      + (f"\n    {f.training_args}" if f.training_args else "") + f"\n    reproduce: {f.reproduce}")
    for n, f in enumerate(typed_only, len(confirmed) + len(crashes) + 1):
        console.print(f"[{n}] {f.id} type-only  {f.checker}  ({f.target} @ {f.layout} {f.config or ''})")
    console.print(f"report: {out_dir / 'report.md'}, {out_dir / 'findings.json'}")
    sys.stdout.flush()
