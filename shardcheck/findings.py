"""Findings: one record per distinct bug, deduplicated by code location and contract.

A finding is stored as ``<root>/findings/<id>.json`` (root defaults to ``.shardcheck``). Its id
is a hash of its location and contract, so finding the same bug again overwrites the record
instead of adding a twin.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

DEFAULT_ROOT = Path(".shardcheck")


def finding_id(location: str, contract: str) -> str:
    """The stable id of the bug at ``location`` breaking ``contract``."""
    return hashlib.sha1(f"{location}\0{contract}".encode()).hexdigest()[:10]


@dataclass
class Finding:
    """A bug the fuzzer found, with its minimal trigger and the numbers that show it."""

    title: str
    target: str
    location: str
    contract: str
    layout: str
    config: dict[str, Any]
    observed: Any
    reference: Any
    corrected: Any = None
    max_error: float | None = None
    checker: str | None = None
    kind: str = "numeric-only"
    repro: str | None = None
    module: str | None = None  # importing it registers the target again, e.g. for `shardcheck repro`
    origin: str = "fuzz"  # or "audit": its target is a Megatron component, its script a template's
    sys_path: list[str] = field(default_factory=list)  # where its script imports the code under test
    id: str = field(default="")

    def __post_init__(self) -> None:
        self.id = self.id or finding_id(self.location, self.contract)

    @property
    def world_size(self) -> int:
        """How many ranks the trigger layout needs."""
        from shardcheck.layout import Layout

        return Layout.parse(self.layout).world_size

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    @classmethod
    def from_json(cls, text: str) -> Finding:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class FindingStore:
    """The findings kept under ``root/findings``."""

    def __init__(self, root: Path | str = DEFAULT_ROOT) -> None:
        self.dir = Path(root) / "findings"

    def path(self, finding_id: str) -> Path:
        return self.dir / f"{finding_id}.json"

    def save(self, finding: Finding) -> bool:
        """Store ``finding``; True when it is new, False when it replaced the same bug's record."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(finding.id)
        is_new = not path.exists()
        if not is_new and not finding.repro:
            finding.repro = self.load(finding.id).repro
        path.write_text(finding.to_json() + "\n")
        return is_new

    def load(self, finding_id: str) -> Finding:
        """The finding with this id (a unique prefix is enough); KeyError when there is none."""
        matches = sorted(self.dir.glob(f"{finding_id}*.json")) if finding_id else []
        if len(matches) != 1:
            reason = "no finding" if not matches else f"{len(matches)} findings"
            raise KeyError(f"{reason} with id {finding_id!r} in {self.dir}")
        return Finding.from_json(matches[0].read_text())

    def all(self) -> list[Finding]:
        """Every stored finding, by id."""
        return [Finding.from_json(p.read_text()) for p in sorted(self.dir.glob("*.json"))]
