"""``shardcheck run``: launch a script on N local ranks like torchrun and report checker findings."""

from __future__ import annotations

import os

import click

from shardcheck.cli.errors import InputError
from shardcheck.parity.launch import run_script


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-n", "--nproc", type=int, default=2, show_default=True, help="Number of local ranks.")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds after which ranks still running are killed as hung.")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(nproc: int, timeout: float, script: str, args: tuple[str, ...]) -> None:
    """Run SCRIPT [ARGS] on N ranks as `torchrun --standalone --nproc-per-node N` would.

    Exit status: 1 if any rank raised a checker error (each distinct `checker:` line is
    printed once, with its ranks), 2 if a rank failed otherwise or hung, 0 when all are clean.
    """
    if script.startswith("-"):
        raise InputError(f"no such option: {script} (options go before SCRIPT; see 'shardcheck run --help')")
    if not os.path.isfile(script):
        raise InputError(f"no such script: {script}")
    if nproc < 1 or timeout <= 0:
        raise InputError("--nproc and --timeout must be positive")
    outcome = run_script(script, args, nproc, timeout)
    if outcome.report():
        click.echo(outcome.report(), err=outcome.exit_code == 2)
    raise SystemExit(outcome.exit_code)
