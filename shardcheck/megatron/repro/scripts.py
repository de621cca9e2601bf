"""Audit findings in the findings store, each confirmed one with its torchrun script.

An audit finding is kept in the same store as the fuzzer's (``ROOT/findings/<id>.json``, id =
hash of location, contract and trigger option names), as a :class:`~shardcheck.fuzz.findings.Finding` whose ``origin`` is
``"audit"``, whose target is the Megatron component and whose config is the trigger's options.
Its script comes from the component's template (:mod:`shardcheck.megatron.repro.templates`),
so ``shardcheck repro ID`` and ``shardcheck findings`` treat audit and fuzz findings alike.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

from shardcheck.fuzz.findings import TYPE_ONLY, Finding, FindingStore
from shardcheck.fuzz.repro import ReproError, write_script
from shardcheck.megatron.audit.report import outputs_moved
from shardcheck.megatron.repro.templates import script_body

CRASH = "crash"


def write_audit_script(finding: Finding, path: Path | str) -> Path:
    """Write the torchrun script of an audit finding; ReproError when it cannot have one."""
    return write_script(finding, script_body, path)


def save_with_scripts(findings: Sequence[Finding], out_dir: Path, root: Path | str, source=None) -> None:
    """Write ``out_dir/repro/<id>.py`` for each confirmed finding, noting on each finding its
    script or why it has none, and save every finding to the store at ``root`` (with the id it
    gets there). A finding of a ``--megatron`` tree (``source``) imports that tree in its script."""
    store = FindingStore(root)
    for finding in findings:
        finding.sys_path = [source.path] if source and source.tree else []
        store.place(finding)
        why = "a crash shows without comparing numbers; rerun its reproduce command" if finding.kind == CRASH else None
        if finding.kind not in (CRASH, TYPE_ONLY) and finding.effect and not outputs_moved(finding):
            why = (f"its outputs equal one rank's, only {finding.effect[0]['value']} differs, which a "
                   "script does not compare; rerun its reproduce command")
        elif finding.kind not in (CRASH, TYPE_ONLY):
            try:
                finding.repro = str(write_audit_script(finding, out_dir / "repro" / f"{finding.id}.py"))
            except ReproError as exc:
                why = str(exc)
        store.save(copy.copy(finding))  # the store may keep a script it holds; the report shows this run's
        if why:
            finding.repro = f"no script: {why}"
