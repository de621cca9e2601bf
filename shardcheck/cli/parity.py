"""``shardcheck parity module:function --layouts tp2,dp2``: parity tables, exit 1 on a mismatch."""

from __future__ import annotations

import importlib
import os
import sys

import click
from rich.console import Console

from shardcheck.cli.errors import InputError, reference_failure
from shardcheck.parity.compare import parity
from shardcheck.parity.layout import Layout, LayoutError
from shardcheck.parity.pool import PoolFailure
from shardcheck.parity.scenario import Scenario


def load_scenario(target: str) -> Scenario:
    """Import ``module:function`` (the current directory is importable) and return the function."""
    module_name, _, function = target.partition(":")
    if not module_name or not function:
        raise InputError(f"expected module:function, got {target!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(f"cannot import {module_name!r}: {exc}") from None
    scenario = getattr(module, function, None)
    if not callable(scenario):
        raise InputError(f"{module_name!r} has no function {function!r}")
    return scenario


def parse_layouts(text: str) -> list[Layout]:
    try:
        return [Layout.parse(part) for part in text.split(",")]
    except LayoutError as exc:
        raise InputError(str(exc)) from None


@click.command("parity")
@click.argument("target", metavar="MODULE:FUNCTION")
@click.option("--layouts", default="tp2,tp2-sp,cp2,dp2,tp2-dp2", show_default=True,
              help="Comma-separated layouts, e.g. tp2,tp2-sp,cp2,dp2,tp2-dp2.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Seconds per run.")
@click.option("--noise-runs", type=click.IntRange(min=0), default=2, show_default=True,
              help="Perturbed reference runs that estimate rounding noise (0: the tolerance of the "
                   "dtype alone).")
def parity_command(target: str, layouts: str, timeout: float, noise_runs: int) -> None:
    """Compare a scenario under each layout with its one-rank reference."""
    chosen = parse_layouts(layouts)
    scenario = load_scenario(target)
    try:
        result = parity(scenario, chosen, timeout=timeout, noise_runs=noise_runs)
    except PoolFailure as failure:
        raise reference_failure(target, failure) from None
    if result is not None:
        Console(width=max(120, Console().width)).print(result)
        raise SystemExit(0 if result.ok else 1)
