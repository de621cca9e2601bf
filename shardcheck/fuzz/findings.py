"""Findings: one record per distinct bug, deduplicated by code location and contract.

A finding is stored as ``<root>/findings/<id>.json`` (root defaults to ``.shardcheck``). Its id
is a hash of its root cause: the location relative to its package (``megatron/core/...``, a path
inside site-packages, or a path inside the project checkout that holds the file), the contract it
breaks and the names of its trigger's options. So the same bug found again, from any checkout on
any machine, overwrites its record instead of adding a twin, and two bugs at one call site with
different triggers are two records. A different cause never replaces a record: should its id be
taken, the store lengthens the new id until it is free.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

DEFAULT_ROOT = Path(".shardcheck")
TYPE_ONLY = "type-only"  # the kind of a finding the type checker alone reports
ID_LENGTH = 10
_INSTALLED = ("/site-packages/", "/dist-packages/")
_PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")


def package_location(location: str) -> str:
    """``location`` (``path:line``, or a description) with its path relative to its package root.

    megatron-core's files start at ``megatron/`` wherever it is installed; other installed files
    start below ``site-packages``; a file of a project checkout starts at the checkout's root (the
    nearest folder above it with ``.git``, ``pyproject.toml``, ``setup.py`` or ``setup.cfg``);
    any other file is its name alone. A relative path to no file here is returned as it is.
    """
    path, sep, rest = location.partition(":")
    if not path.endswith(".py"):
        return location
    posix = Path(path).as_posix()
    for marker in ("/megatron/core/", *_INSTALLED):
        index = posix.rfind(marker)
        if index >= 0:
            start = index + 1 if marker == "/megatron/core/" else index + len(marker)
            return posix[start:] + sep + rest
    file = Path(path)
    if not file.is_absolute():
        if not file.exists():
            return location  # already relative to its package, e.g. megatron/core/...
        file = file.resolve()
    for parent in file.parents:
        if any((parent / marker).exists() for marker in _PROJECT_MARKERS):
            return file.relative_to(parent).as_posix() + sep + rest
    return file.name + sep + rest


def cause_digest(location: str, contract: str, options: Iterable[str] = ()) -> str:
    """The full hash of a root cause: package-relative location, contract, trigger option names."""
    key = "\0".join([package_location(location), contract, *sorted(set(options))])
    return hashlib.sha1(key.encode()).hexdigest()


def finding_id(location: str, contract: str, options: Iterable[str] = ()) -> str:
    """The stable id of the bug at ``location`` breaking ``contract`` when ``options`` are set."""
    return cause_digest(location, contract, options)[:ID_LENGTH]


AUDIT = "audit"  # the origin of an audit's finding: its target is a Megatron component
STORED = ("title", "target", "location", "contract", "layout", "config", "observed", "reference",
          "corrected", "max_error", "checker", "kind", "repro", "module", "origin", "options",
          "sys_path", "id", "control")  # the fields a store record holds, in its order (an audit's
# corrected control too: `shardcheck repro` builds a script's --fixed from the fix it names)


@dataclass
class Finding:
    """One distinct bug, found by the fuzzer or the audit: where it is, the contract it breaks, its
    minimal trigger (``target`` under ``layout`` with ``config``) and the numbers that show it.

    The store keeps the fields every finding has (:data:`STORED`, :meth:`to_json`). An audit's
    finding (:meth:`audited`) also carries how the audit found it, the report that its
    findings.json holds (:meth:`report_entry`): the effect on each diverging value, the first
    divergence, the corrected control, the command and the cases of its cause.
    """

    title: str
    target: str
    location: str
    contract: str
    layout: str
    config: dict[str, Any]
    observed: Any
    reference: Any
    corrected: Any = None  # what the corrected run gave: its numbers, or an audit control's result line
    max_error: float | None = None
    checker: str | None = None
    kind: str = "numeric-only"
    repro: str | None = None
    module: str | None = None  # importing it registers the target again, e.g. for `shardcheck repro`
    origin: str = "fuzz"  # or AUDIT: its target is a Megatron component, its script a template's
    options: list[str] = field(default_factory=list)  # the trigger's option names, part of the cause
    sys_path: list[str] = field(default_factory=list)  # where its script imports the code under test
    id: str = field(default="")
    effect: list[dict[str, Any]] = field(default_factory=list)  # audit: the diverging values, first first
    first_divergence: str | None = None  # audit: the first contracted call that diverged
    control: dict[str, Any] | None = None  # audit: the corrected control (fix, result, equal_to_reference)
    reproduce: str = ""  # audit: the `shardcheck audit` command that runs the trigger
    seen_in: list[str] = field(default_factory=list)  # audit: the layouts and options it shows under
    cases: list[dict[str, Any]] = field(default_factory=list)  # audit: every case of this cause
    same_fix: list[dict[str, Any]] = field(default_factory=list)  # audit: independent triggers it repairs
    one_rank: str | None = None  # audit, a crash: the exception the layout causes, while one rank runs
    training_args: str | None = None  # audit: megatron.training's validate_args refusing the trigger's configuration
    first_op: str | None = None  # audit, numeric-only: the first op whose values part ways ("first op: ...")
    showed: str | None = None  # audit: where it showed, when the location is a line upstream of it

    def __post_init__(self) -> None:
        self.options = sorted(set(self.options))
        self.id = self.id or finding_id(self.location, self.contract, self.options)

    @classmethod
    def audited(cls, trigger: dict[str, Any], effect: list[dict[str, Any]], control: dict[str, Any] | None,
                **report: Any) -> Finding:
        """An audit's finding of ``trigger`` (component, options, layout) with its effect, its
        corrected control and the rest of its ``report``; the store's numbers are its first effect's
        (shown as the report shows them) and its control's result line."""
        first = effect[0] if effect else {}
        return cls(target=trigger["component"], layout=trigger["layout"], config=trigger["options"],
                   observed=show_number(first["observed"]) if first else None,
                   reference=show_number(first["reference"]) if first else None,
                   corrected=control["result"] if control else None, max_error=first.get("max_abs_error"),
                   origin=AUDIT, options=list(trigger["options"]), effect=effect, control=control, **report)

    @classmethod
    def from_report(cls, entry: dict[str, Any]) -> Finding:
        """The finding an entry of an audit's findings.json holds (a docs example keeps a few fields)."""
        report = {k: v for k, v in entry.items() if k not in ("trigger", "effect", "corrected")}
        report.setdefault("contract", "")
        return cls.audited(entry["trigger"], entry.get("effect") or [], entry.get("corrected"), **report)

    @property
    def trigger(self) -> dict[str, Any]:
        """The minimal trigger as an audit's report shows it: component, options and layout."""
        return {"component": self.target, "options": self.config, "layout": self.layout}

    @property
    def cause(self) -> str:
        """The full hash of what identifies the bug; the id is a prefix of it."""
        return cause_digest(self.location, self.contract, self.options)

    @property
    def world_size(self) -> int:
        """How many ranks the trigger layout needs."""
        from shardcheck.parity.layout import Layout

        return Layout.parse(self.layout).world_size

    def report_entry(self) -> dict[str, Any]:
        """The finding as an audit's findings.json holds it."""
        return {"title": self.title, "kind": self.kind, "location": self.location, "contract": self.contract,
                "trigger": self.trigger, "effect": self.effect, "first_divergence": self.first_divergence,
                "checker": self.checker, "corrected": self.control, "reproduce": self.reproduce,
                "seen_in": self.seen_in, "id": self.id, "repro": self.repro, "cases": self.cases,
                "same_fix": self.same_fix, "one_rank": self.one_rank, "training_args": self.training_args,
                "first_op": self.first_op, "showed": self.showed}

    def to_json(self) -> str:
        """The store's record (:data:`STORED`; an audit's report stays in its findings.json)."""
        return json.dumps({name: getattr(self, name) for name in STORED}, indent=2, default=str)

    @classmethod
    def from_json(cls, text: str) -> Finding:
        """The finding a record holds; ValueError saying what is wrong when it holds none."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object but a {type(data).__name__}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in STORED})


def show_number(value: Any) -> str:
    """A scalar with 6 significant digits; a tensor as its shape and first values."""
    if not isinstance(value, list):
        return f"{value:.6g}" if isinstance(value, float) else str(value)
    flat, shape, inner = [], [], value
    while isinstance(inner, list):
        shape.append(len(inner))
        inner = inner[0] if inner else None
    stack = [value]
    while stack and len(flat) < 4:
        item = stack.pop(0)
        if isinstance(item, list):
            stack = item + stack
        else:
            flat.append(f"{item:.6g}")
    return f"shape {shape} [{', '.join(flat)}, ...]"


class StoreError(ValueError):
    """A file in the findings store that holds no finding; its message names the file."""


def _read(path: Path) -> Finding:
    """The finding stored in ``path``; :class:`StoreError` when the file holds none."""
    try:
        return Finding.from_json(path.read_text())
    except (ValueError, TypeError) as exc:  # TypeError: a field of the wrong type
        raise StoreError(f"corrupt findings store entry {path}: {exc}") from None


class FindingStore:
    """The findings kept under ``root/findings``."""

    def __init__(self, root: Path | str = DEFAULT_ROOT) -> None:
        self.dir = Path(root) / "findings"

    def path(self, finding_id: str) -> Path:
        return self.dir / f"{finding_id}.json"

    def place(self, finding: Finding) -> str:
        """Give ``finding`` the id under which it is stored: its own, unless a record of another
        cause holds that id, then the shortest longer prefix of its cause that is free or its own."""
        for length in range(len(finding.id), len(finding.cause) + 1, 2):
            candidate = finding.cause[:length] if length > len(finding.id) else finding.id
            held = self._stored(candidate)
            if held is None or held.cause == finding.cause:
                finding.id = candidate
                return candidate
        raise ValueError(f"no free id for finding {finding.cause} in {self.dir}")

    def save(self, finding: Finding) -> bool:
        """Store ``finding``; True when it is new, False when it replaced the same bug's record.
        A record of another cause is never replaced (see :meth:`place`)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        held = self._stored(self.place(finding))
        if held is not None and not finding.repro:
            finding.repro = held.repro
        self.path(finding.id).write_text(finding.to_json() + "\n")
        return held is None

    def _stored(self, finding_id: str) -> Finding | None:
        path = self.path(finding_id)
        return _read(path) if path.exists() else None

    def load(self, finding_id: str) -> Finding:
        """The finding with this id (a unique prefix is enough); KeyError when there is none."""
        if finding_id and self.path(finding_id).exists():
            return _read(self.path(finding_id))
        matches = sorted(self.dir.glob(f"{finding_id}*.json")) if finding_id else []
        if len(matches) != 1:
            reason = "no finding" if not matches else f"{len(matches)} findings"
            raise KeyError(f"{reason} with id {finding_id!r} in {self.dir}")
        return _read(matches[0])

    def all(self) -> list[Finding]:
        """Every stored finding, by id."""
        return [_read(p) for p in sorted(self.dir.glob("*.json"))]
