"""The ``fuzz``, ``repro`` and ``findings`` commands."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardcheck.cli.errors import (
    EXIT_FOUND,
    InputError,
    input_errors,
    reference_failure,
    writable_folder,
)
from shardcheck.fuzz.campaign import FuzzError, FuzzTarget, fuzz, registered_targets, resolve_target
from shardcheck.fuzz.findings import (
    AUDIT,
    DEFAULT_ROOT,
    Finding,
    FindingStore,
    StoreError,
    package_location,
)
from shardcheck.fuzz.repro import REPRODUCES, ReproError, run_repro
from shardcheck.megatron.cpu import MEGATRON_PRELOAD
from shardcheck.parity.layout import LayoutError
from shardcheck.parity.pool import PoolFailure

CATALOGUE_NEEDS = "megatron.core"  # the Megatron components are fuzz targets where it is installed
_root_option = click.option("--root", default=str(DEFAULT_ROOT), show_default=True,
                            type=click.Path(file_okay=False), help="Where findings and the example database live.")


def _target(spec: str, typecheck: bool = True, module: str | None = None) -> FuzzTarget:
    """Resolve a target; component names may need the Megatron catalogue imported first."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # module:function scenarios next to the user
    if ":" not in spec and spec not in registered_targets() and not module and _exists(CATALOGUE_NEEDS):
        with warnings.catch_warnings():  # Megatron's "Apex is not installed" and deprecation notes
            warnings.simplefilter("ignore")
            from shardcheck.megatron import fuzz_targets
        fuzz_targets.register_catalogue()
    try:
        return resolve_target(spec, typecheck, module)
    except (FuzzError, LayoutError) as exc:
        raise InputError(str(exc)) from None


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _show_findings(findings: list[Finding], statuses: dict[str, str] | None = None) -> None:
    table = Table("id", *(["status"] if statuses is not None else []), "kind", "trigger",
                  "observed", "reference", "location")
    for f in findings:
        status = [statuses[f.id]] if statuses is not None else []
        table.add_row(f.id, *status, f.kind, escape(f"{f.layout} {f.config}"), escape(str(f.observed)),
                      escape(str(f.reference)), escape(package_location(f.location)))
    console = Console(width=160)
    console.print(table)
    for f in findings:
        console.print(f"{f.id}: {escape(f.title)}" + (f"\n  repro: {f.repro}" if f.repro else ""),
                      highlight=False)


@click.command("fuzz")
@click.argument("target")
@click.option("--budget", default=50, show_default=True, type=click.IntRange(1),
              help="How many examples hypothesis may try (shrinking comes on top).")
@click.option("--seed", type=int, default=None, help="Make the search reproducible.")
@click.option("--no-typecheck", is_flag=True,
              help="Parity only: for a scenario whose inputs carry no declared types.")
@_root_option
@input_errors(StoreError)
def fuzz_command(target: str, budget: int, seed: int | None, no_typecheck: bool, root: str) -> None:
    """Search TARGET's layouts, configurations and inputs for failures; shrink and store them.

    TARGET is a scenario as module:function, or a registered component name. Exits 1 when a
    failure is found.
    """
    resolved = _target(target, not no_typecheck)
    writable_folder(root)
    console = Console(stderr=True)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # deprecation notes of
    # the config fields an example sets, as the audit leaves them out
    try:
        with console.status(f"fuzzing {resolved.name}") as status:
            def show(examples: int, failing: int) -> None:
                status.update(f"fuzzing {resolved.name}: {examples} examples run, {failing} failing")
            campaign = fuzz(resolved, budget=budget, seed=seed, root=root, progress=show)
    except (FuzzError, LayoutError, ReproError) as exc:
        raise InputError(str(exc)) from None
    except Exception as exc:  # the one-rank reference failed: hypothesis raises it, maybe grouped
        failure = _pool_failure(exc)
        if failure is None:
            raise
        raise reference_failure(target, failure) from None
    click.echo(f"{campaign.target}: {campaign.examples} examples in {campaign.seconds:.1f} s, "
               f"{len(campaign.findings)} finding(s), {len(campaign.new)} new")
    if campaign.findings:
        _show_findings(campaign.findings)
        sys.exit(EXIT_FOUND)


def _pool_failure(exc: BaseException) -> PoolFailure | None:
    if isinstance(exc, PoolFailure):
        return exc
    inner = getattr(exc, "exceptions", None) or []
    return next(filter(None, map(_pool_failure, inner)), None)


@click.command("repro")
@click.argument("finding_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Where to write the script (default: ROOT/repro/<id>.py).")
@_root_option
@input_errors(StoreError)
def repro_command(finding_id: str, output: str | None, root: str) -> None:
    """Write the self-contained torchrun script that reproduces finding FINDING_ID."""
    store = FindingStore(root)
    try:
        finding = store.load(finding_id)
        path = Path(output) if output else Path(root) / "repro" / f"{finding.id}.py"
        path = _write_script(finding, writable_folder(path.parent) / path.name)
    except (KeyError, ReproError) as exc:
        raise InputError(exc.args[0]) from None
    if output is None:
        finding.repro = str(path)
        store.save(finding)
    click.echo(f"wrote {path}\nrun:  torchrun --standalone --nproc-per-node={finding.world_size} {path}")


def _write_script(finding: Finding, path: Path | str) -> Path:
    """An audit finding's script from its component's template, a fuzz finding's from its target."""
    if finding.origin == AUDIT:
        warnings.filterwarnings("ignore", category=UserWarning)  # Megatron's "Apex is not installed"
        from shardcheck.megatron.repro.scripts import write_audit_script

        return write_audit_script(finding, path)
    return _target(finding.target, module=finding.module).write_repro(finding, path)


@click.command("findings")
@click.option("--no-run", is_flag=True, help="List without rerunning the repro scripts.")
@click.option("--launcher", type=click.Choice(["direct", "torchrun"]), default="direct", show_default=True,
              help="How to start the scripts' ranks: directly (faster), or under torchrun.")
@_root_option
@input_errors(StoreError)
def findings_command(no_run: bool, launcher: str, root: str) -> None:
    """List the stored findings with their status, by rerunning their repro scripts.

    Exits 1 when a finding still reproduces, else 0; with --no-run nothing is rerun, so it
    lists them and exits 0.
    """
    findings = FindingStore(root).all()
    if not findings:
        click.echo(f"no findings in {Path(root) / 'findings'}")
        return
    statuses = None if no_run else {f.id: _status(f, launcher) for f in findings}
    _show_findings(findings, statuses)
    if statuses and REPRODUCES in statuses.values():
        sys.exit(EXIT_FOUND)


def _status(finding: Finding, launcher: str) -> str:
    if not finding.repro or not Path(finding.repro).exists():
        return "no script"
    preload = MEGATRON_PRELOAD if finding.origin == AUDIT else ("torch",)  # direct ranks fork from a warm server
    return run_repro(finding.repro, finding.world_size, launcher=launcher, preload=preload).status
