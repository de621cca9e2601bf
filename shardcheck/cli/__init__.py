"""The ``shardcheck`` command line."""

from __future__ import annotations

import click

from shardcheck import __version__
from shardcheck.cli.audit import audit_command
from shardcheck.cli.errors import Group
from shardcheck.cli.fuzz import findings_command, fuzz_command, repro_command
from shardcheck.cli.golden import golden
from shardcheck.cli.parity import parity_command
from shardcheck.cli.run import run
from shardcheck.cli.train import train_command


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="shardcheck")
def main() -> None:
    """Find silent numerical-correctness bugs in distributed PyTorch training.

    Every command exits 0 when clean, 1 when it found something, 2 on bad input or when the
    run itself failed.
    """


main.add_command(golden)
main.add_command(run)
main.add_command(parity_command)
main.add_command(fuzz_command)
main.add_command(repro_command)
main.add_command(findings_command)
main.add_command(audit_command)
main.add_command(train_command)
