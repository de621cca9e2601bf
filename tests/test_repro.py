"""Emitted repro scripts run under torchrun: REPRODUCED and exit 0, then exit 1 once fixed."""

import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner
from planted import bugs, targets

from shardcheck.cli import main
from shardcheck.fuzz.campaign import fuzz, resolve_target
from shardcheck.fuzz.findings import Finding, FindingStore
from shardcheck.fuzz.repro import (
    BROKEN,
    FIXED,
    REPRODUCES,
    ReproError,
    ScriptBody,
    render_script,
    run_repro,
)

PLANTED = {
    "planted-masked-mean": bugs.masked_mean_loss,
    "planted-smoothed-ce": bugs.vocab_parallel_cross_entropy,
    "planted-token-mean": bugs.weighted_token_mean,
    "planted-sequence-sum": bugs.split_sequence_sum,
}


def _printed(output: str, label: str) -> float:
    line = next(line for line in output.splitlines() if line.startswith(f"{label}:"))
    return float(line.split(":", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANTED))
def test_emitted_script_reproduces_then_passes_once_fixed(name):
    [finding] = targets.campaign(name).findings
    script = open(finding.repro).read()
    assert not re.search(r"^\s*(import|from)\s+shardcheck", script, re.M)
    assert len(script.splitlines()) <= 150

    # torchrun for one planted bug; the same scripts under the direct launcher for the others,
    # their ranks forked from a server that imported torch (tests/test_forkserver.py: a forked
    # rank runs a script as a fresh one does)
    launcher = "torchrun" if name == "planted-masked-mean" else "direct"
    preload = ("torch", "torch.distributed") if launcher == "direct" else ()
    buggy = run_repro(finding.repro, finding.world_size, launcher=launcher, timeout=600, preload=preload)
    assert (buggy.status, buggy.returncode) == (REPRODUCES, 0), buggy.output
    assert f"REPRODUCED {finding.id}" in buggy.output
    assert _printed(buggy.output, "observed") == pytest.approx(finding.observed["value"], rel=1e-6)
    assert _printed(buggy.output, "reference") == pytest.approx(finding.reference["value"], rel=1e-6)
    assert _printed(buggy.output, "corrected") == pytest.approx(finding.reference["value"], rel=1e-6)
    checker_lines = [line for line in buggy.output.splitlines() if line.startswith("checker:")]
    assert checker_lines == ([finding.checker] if finding.checker else [])

    fixed = run_repro(finding.repro, finding.world_size, env={"PLANTED_FIXES": PLANTED[name].__name__},
                      launcher=launcher, timeout=600, preload=preload)
    assert (fixed.status, fixed.returncode) == (FIXED, 1), fixed.output
    assert "REPRODUCED" not in fixed.output


def _finding(**changes) -> Finding:
    fields = dict(title="t", target="x", location="here.py:1", contract="c", layout="dp2",
                  config={"n": 1}, observed=1.0, reference=2.0)
    return Finding(**{**fields, **changes})


def test_script_without_fix_control_prints_no_corrected_line():
    text = render_script(_finding(), ScriptBody(code="def observed():\n    return torch.ones(1)\n"))
    assert "corrected" not in text and "CONFIG = {'n': 1}" in text and "--nproc-per-node=2" in text
    compile(text, "repro.py", "exec")


@pytest.mark.slow
def test_a_crashing_script_is_an_error_not_a_fix(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("raise SystemExit(3)\n")
    assert run_repro(script, 1, launcher="direct").status == BROKEN


@pytest.mark.slow
def test_cli_repro_writes_the_script_and_findings_reports_its_status(tmp_path):
    [finding] = fuzz("planted-token-mean", budget=30, seed=0, root=tmp_path, write_repros=False).findings
    assert FindingStore(tmp_path).load(finding.id).repro is None
    out = tmp_path / "mine.py"
    # a fresh process: the finding itself says which module registers its target
    written = subprocess.run([sys.executable, "-m", "shardcheck", "repro", finding.id[:6], "-o", str(out),
                              "--root", str(tmp_path)], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert written.returncode == 0, written.stderr
    assert f"torchrun --standalone --nproc-per-node=2 {out}" in written.stdout and out.exists()

    CliRunner().invoke(main, ["repro", finding.id, "--root", str(tmp_path)])
    listed = CliRunner().invoke(main, ["findings", "--root", str(tmp_path)])
    assert listed.exit_code == 1 and REPRODUCES in listed.output  # 1: a stored finding still reproduces


def test_cli_repro_of_unknown_finding_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["repro", "feedbeef", "--root", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().startswith("Error: no finding with id 'feedbeef'")


def test_type_only_finding_gets_no_script(tmp_path):
    target = resolve_target("planted-masked-mean")
    with pytest.raises(ReproError, match="type-only"):
        target.write_repro(_finding(kind="type-only"), tmp_path / "x.py")
    assert not (tmp_path / "x.py").exists()
