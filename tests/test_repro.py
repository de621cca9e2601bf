"""Emitted repro scripts run under torchrun: REPRODUCED and exit 0, then exit 1 once fixed."""

import pytest
from click.testing import CliRunner
from planted import bugs, targets  # noqa: F401 - registers the planted targets

from shardcheck.cli import main
from shardcheck.findings import Finding, FindingStore
from shardcheck.fuzz import fuzz
from shardcheck.repro import BROKEN, FIXED, REPRODUCES, ScriptBody, render_script, run_repro

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
def test_emitted_script_reproduces_then_passes_once_fixed(name, tmp_path):
    [finding] = fuzz(name, budget=30, seed=0, root=tmp_path).findings
    script = open(finding.repro).read()
    assert "shardcheck" not in script and len(script.splitlines()) <= 150

    buggy = run_repro(finding.repro, finding.world_size)
    assert (buggy.status, buggy.returncode) == (REPRODUCES, 0), buggy.output
    assert f"REPRODUCED {finding.id}" in buggy.output
    assert _printed(buggy.output, "observed") == pytest.approx(finding.observed["value"], rel=1e-6)
    assert _printed(buggy.output, "reference") == pytest.approx(finding.reference["value"], rel=1e-6)
    assert _printed(buggy.output, "corrected") == pytest.approx(finding.reference["value"], rel=1e-6)

    fixed = run_repro(finding.repro, finding.world_size, env={"PLANTED_FIXES": PLANTED[name].__name__})
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
    assert run_repro(script, 1).status == BROKEN


@pytest.mark.slow
def test_cli_repro_writes_the_script_and_findings_reports_its_status(tmp_path):
    [finding] = fuzz("planted-token-mean", budget=30, seed=0, root=tmp_path, write_repros=False).findings
    assert FindingStore(tmp_path).load(finding.id).repro is None
    out = tmp_path / "mine.py"
    written = CliRunner().invoke(main, ["repro", finding.id[:6], "-o", str(out), "--root", str(tmp_path)])
    assert written.exit_code == 0, written.output
    assert f"torchrun --standalone --nproc-per-node=2 {out}" in written.output and out.exists()

    CliRunner().invoke(main, ["repro", finding.id, "--root", str(tmp_path)])
    listed = CliRunner().invoke(main, ["findings", "--root", str(tmp_path)])
    assert listed.exit_code == 0 and REPRODUCES in listed.output


def test_cli_repro_of_unknown_finding_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["repro", "feedbeef", "--root", str(tmp_path)])
    assert result.exit_code == 1
    assert result.output.strip().startswith("Error: no finding with id 'feedbeef'")
