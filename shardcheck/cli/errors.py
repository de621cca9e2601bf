"""The command line's error contract, the same in every command.

Exit status 0: clean; 1: found something (a bug, a regression); 2: bad input or a harness
failure. A user's mistake is one ``Error:`` line on stderr, with no traceback; a failure of
shardcheck itself keeps its traceback (it is a bug to report) and exits 2 as well.
"""

from __future__ import annotations

import functools
import re
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from shardcheck.parity.launch import first_failures

EXIT_CLEAN, EXIT_FOUND, EXIT_ERROR = 0, 1, 2
_LAST_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<name>\w+(?:Error|Exception|Warning)?): (?P<message>.*)$")


class InputError(click.ClickException):
    """Bad user input: printed as one ``Error:`` line, exit status 2."""

    exit_code = EXIT_ERROR


class HarnessFailure(click.ClickException):
    """A run that could not be judged (the reference failed, ranks died): exit status 2.

    Its message may carry the failing rank's own traceback after the first line.
    """

    exit_code = EXIT_ERROR


def input_errors(*kinds: type[Exception]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A command decorator: the exceptions ``kinds`` of the core become :class:`InputError`."""
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return command(*args, **kwargs)
            except kinds as exc:
                raise InputError(str(exc)) from None
        return wrapper
    return decorate


def writable_folder(path: Path | str) -> Path:
    """Check, before a command's work starts and without creating anything, that it can make
    and fill the folder ``path``: the nearest folder of it or above it that exists takes a file.
    One ``Error: cannot write to PATH: REASON`` line when not."""
    folder = Path(path)
    existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise InputError(f"cannot write to {path}: {existing} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise InputError(f"cannot write to {path}: {exc.strerror or exc}") from None
    return folder


def last_line(traceback_text: str) -> str:
    """``Name: message`` of a formatted traceback, its module path dropped."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    if not lines:
        return "no traceback"
    match = _LAST_LINE.match(lines[-1].strip())
    return f"{match['name']}: {match['message']}" if match else lines[-1].strip()


def reference_failure(target: str, failure: Any) -> click.ClickException:
    """The error for a :class:`~shardcheck.parity.pool.PoolFailure` of a scenario's one-rank run.

    A scenario returning the wrong type is the user's mistake: one line. A scenario that
    raises or hangs is a run that cannot be judged: the first line says so, then the first
    failing rank's own traceback follows.
    """
    if failure.kind != "error" or not failure.tracebacks:
        return HarnessFailure(f"the one-rank reference of {target} failed: {failure}")
    rank, text = first_failures(failure.tracebacks)[0]
    cause = last_line(text)
    if cause.startswith("ScenarioOutputError: "):
        return InputError(cause.removeprefix("ScenarioOutputError: "))
    return HarnessFailure(f"the one-rank reference of {target} failed: rank {rank} raised {cause}\n"
                          f"{text.rstrip()}")


def _one_line(exc: click.ClickException) -> str:
    message = " ".join(exc.format_message().split()) if not isinstance(exc, HarnessFailure) \
        else exc.format_message()
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return f"Error: {message}"


class Group(click.Group):
    """A click group whose errors follow the contract above."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:
            click.echo(_one_line(exc), err=True)
            sys.exit(EXIT_ERROR)
        except click.Abort:
            click.echo("Aborted.", err=True)
            sys.exit(130)
        except (SystemExit, KeyboardInterrupt):
            raise
        except Exception:  # noqa: BLE001 - shardcheck's own bug: keep the traceback, exit 2
            traceback.print_exc()
            click.echo("Error: shardcheck failed (a bug in shardcheck: the traceback above)", err=True)
            sys.exit(EXIT_ERROR)
        sys.exit(code if isinstance(code, int) else EXIT_CLEAN)
