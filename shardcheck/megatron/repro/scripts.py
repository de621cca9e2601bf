"""Audit findings in the findings store, each confirmed one with its torchrun script.

An audit finding is kept in the same store as the fuzzer's (``ROOT/findings/<id>.json``, id =
hash of location, contract and trigger option names), as a :class:`~shardcheck.fuzz.findings.Finding` whose ``origin`` is
``"audit"``, whose target is the Megatron component and whose config is the trigger's options.
Its script comes from the component's template (:mod:`shardcheck.megatron.repro.templates`),
so ``shardcheck repro ID`` and ``shardcheck findings`` treat audit and fuzz findings alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from shardcheck.fuzz.findings import TYPE_ONLY, Finding, FindingStore
from shardcheck.fuzz.repro import ReproError, write_script
from shardcheck.megatron.audit import report as audit_report
from shardcheck.megatron.repro.templates import script_body

AUDIT = "audit"
CRASH = "crash"


def as_stored(finding: audit_report.Finding, source=None) -> Finding:
    """The store's record of an audit finding (same id); a finding of a ``--megatron`` tree
    (``source``) imports that tree in its script."""
    first = finding.effect[0] if finding.effect else {}
    return Finding(
        title=finding.title, target=finding.trigger["component"], location=finding.location,
        contract=finding.contract, layout=finding.trigger["layout"], config=finding.trigger["options"],
        observed=audit_report.show_number(first["observed"]) if first else None,
        reference=audit_report.show_number(first["reference"]) if first else None,
        corrected=finding.corrected["result"] if finding.corrected else None,
        max_error=first.get("max_abs_error"), checker=finding.checker, kind=finding.kind,
        origin=AUDIT, options=list(finding.trigger["options"]), id=finding.id,
        sys_path=[source.path] if source and source.tree else [])


def write_audit_script(finding: Finding, path: Path | str) -> Path:
    """Write the torchrun script of a stored audit finding; ReproError when it cannot have one."""
    return write_script(finding, script_body, path)


def save_with_scripts(findings: Sequence[audit_report.Finding], out_dir: Path, root: Path | str,
                      source=None) -> None:
    """Write ``out_dir/repro/<id>.py`` for each confirmed finding, noting on each finding its
    script or why it has none, and save every finding to the store at ``root``."""
    store = FindingStore(root)
    for finding in findings:
        stored = as_stored(finding, source)
        finding.id = store.place(stored)
        if finding.kind == CRASH:
            finding.repro = "no script: a crash shows without comparing numbers; rerun its reproduce command"
        elif finding.kind != TYPE_ONLY:
            try:
                stored.repro = str(write_audit_script(stored, out_dir / "repro" / f"{finding.id}.py"))
                finding.repro = stored.repro
            except ReproError as exc:
                finding.repro = f"no script: {exc}"
        store.save(stored)
