"""``shardcheck audit`` on the command line: a real reproduce run, and bad input."""

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("megatron.core")

from shardcheck.cli import main  # noqa: E402
from shardcheck.fuzz.findings import FindingStore  # noqa: E402


@pytest.mark.parametrize(("args", "message"), [
    (["--layouts", "tp2,tpx"], "malformed layout"),
    (["--only", "nothing"], "unknown component"),
    (["--budget", "3", "--time-limit", "1"], "not both"),
    (["--only", "output_loss", "--set", "label_smoothing"], "is not NAME=VALUE"),
    (["--only", "output_loss", "--set", "no_such_option=1"], "no option"),
    (["--budget", "0"], "Invalid value"),
])
def test_bad_input_gets_one_clear_line_and_a_nonzero_exit(args, message, tmp_path):
    result = CliRunner().invoke(main, ["audit", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "report.md").exists()


@pytest.mark.slow
def test_reproduce_command_reruns_one_finding_and_writes_the_report(tmp_path):
    args = ["audit", "--only", "output_loss", "--layouts", "tp2", "--set", "label_smoothing=0.1",
            "--out", str(tmp_path), "--root", str(tmp_path / "store")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output  # found something
    assert "1 finding(s) confirmed by parity, 0 type-only" in result.output
    assert "checker: mean over shard at megatron/core/tensor_parallel/cross_entropy.py:" in result.output
    data = json.loads((tmp_path / "findings.json").read_text())
    [finding] = data["findings"]
    assert finding["trigger"] == {"component": "output_loss", "options": {"label_smoothing": 0.1},
                                  "layout": "tp2"}
    assert finding["reproduce"] == "shardcheck audit --only output_loss --layouts tp2 --set label_smoothing=0.1"
    assert "## Findings confirmed by parity (1)" in (tmp_path / "report.md").read_text()
    script = tmp_path / "repro" / f"{finding['id']}.py"
    assert finding["repro"] == str(script) and "vocab_parallel_cross_entropy(" in script.read_text()
    assert f"torchrun --standalone --nproc-per-node=2 {script}" in (tmp_path / "report.md").read_text()
    [stored] = FindingStore(tmp_path / "store").all()
    assert (stored.id, stored.origin, stored.repro) == (finding["id"], "audit", str(script))


def test_every_option_the_sweep_sets_reads_back_from_its_reproduce_command():
    """What a reproduce command says (``--set name=value``) sets the case's own options: a
    choice spelled like a keyword (gpt's position_embedding='none') stays the string."""
    from shardcheck.cli.audit import _fixed_options
    from shardcheck.megatron.audit.report import reproduce_command
    from shardcheck.megatron.audit.sweep import components_plan
    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.parity.layout import Layout

    cases = [case for case in components_plan(COMPONENTS, [Layout.parse("tp2")]) if case.options]
    assert any(dict(case.options).get("position_embedding") == "none" for case in cases)
    for case in cases:
        pairs = tuple(reproduce_command(case).split("--set ")[1:])
        assert _fixed_options([case.component], tuple(p.strip() for p in pairs)) == case.options, case
