"""Megatron's functional-test configs through ``shardcheck train``'s planning, without ranks.

Each ``model_config.yaml`` is shrunk as ``--model-config`` shrinks it and planned as
``shardcheck train`` plans it before it starts ranks (:func:`plan_runs`), and classed as

- ``planned``: ``shardcheck train --model-config PATH`` would start its runs;
- ``refused``: one line (exit 2), grouped by the flag that line names;
- ``crashed``: any other exception, which a user would see as a traceback (a bug here).

``python -m shardcheck.megatron.train.survey FOLDER...`` prints the table per family (the
folder above each config's own) and, with ``-v``, each config's class and line.
"""

from __future__ import annotations

import argparse
import re
import traceback
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardcheck.megatron.train.args import TrainInputError, plan_runs
from shardcheck.megatron.train.config import flags_from_model_config

PLANNED, REFUSED, CRASHED = "planned", "refused", "crashed"
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


@dataclass(frozen=True)
class Outcome:
    """One config's class, its refusal's flag (``refused`` only), and its one line."""

    path: Path
    kind: str
    flag: str = ""
    line: str = ""

    @property
    def family(self) -> str:
        return self.path.parent.parent.name


def plan_config(path: Path) -> Outcome:
    """Shrink and plan the config at ``path`` as ``shardcheck train --model-config PATH`` does."""
    try:
        shrunk = flags_from_model_config(path)
        plan = plan_runs(shrunk.flags, shrunk.nproc, None, cpu=True, own_entry=True)
    except TrainInputError as exc:
        line = str(exc).removeprefix(f"{path}: ")
        named = _FLAG.match(line)
        return Outcome(path, REFUSED, named.group() if named else re.split(r" \(|:", line)[0], line)
    except Exception as exc:  # noqa: BLE001 -- what a user would see as a traceback
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return Outcome(path, CRASHED, "", f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})")
    return Outcome(path, PLANNED, "", f"{plan.world} ranks")


def survey(configs: Iterable[Path]) -> list[Outcome]:
    """Every config's :class:`Outcome`, in the order given."""
    return [plan_config(path) for path in configs]


def model_configs(folders: Sequence[Path]) -> list[Path]:
    """The ``model_config.yaml`` files under ``folders``, sorted."""
    return sorted(path for folder in folders for path in Path(folder).rglob("model_config.yaml"))


def table(outcomes: Sequence[Outcome]) -> list[str]:
    """A Markdown table: per family, the configs planned, refused (by flag, with counts), crashed."""
    families: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        families[outcome.family].append(outcome)
    lines = ["| family | configs | planned | refused (by flag) | crashed |", "|---|---|---|---|---|"]
    for family, group in sorted(families.items()):
        kinds = Counter(o.kind for o in group)
        flags = Counter(o.flag for o in group if o.kind == REFUSED)
        refused = ", ".join(f"`{flag}` {n}" for flag, n in flags.most_common()) or "0"
        lines.append(f"| {family} | {len(group)} | {kinds[PLANNED]} | "
                     f"{kinds[REFUSED]}{': ' + refused if kinds[REFUSED] else ''} | {kinds[CRASHED]} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table for the configs under the folders given; exit 1 when one crashed."""
    parser = argparse.ArgumentParser(prog="python -m shardcheck.megatron.train.survey",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="folders holding */*/model_config.yaml")
    parser.add_argument("-v", "--verbose", action="store_true", help="also each config's class and line")
    options = parser.parse_args(argv)
    outcomes = survey(model_configs(options.folders))
    if options.verbose:
        for outcome in outcomes:
            print(f"{outcome.kind:8} {outcome.family}/{outcome.path.parent.name}: {outcome.line}")
    print("\n".join(table(outcomes)))
    return 1 if any(o.kind == CRASHED for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
