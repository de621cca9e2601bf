from pathlib import Path

import pytest
from click.testing import CliRunner

from shardcheck.cli import main


def test_parity_command_prints_tables_and_exits_1_on_a_mismatch():
    result = CliRunner().invoke(main, ["parity", "parity_scenarios:tiny_bug", "--layouts", "tp2,dp2"])
    assert result.exit_code == 1, result.output
    assert "parity tp2 vs 1 rank: MISMATCH" in result.output
    assert result.output.count("first diverging module: block.fc2") == 2


def test_parity_command_exits_0_when_every_layout_matches():
    result = CliRunner().invoke(main, ["parity", "parity_scenarios:correct", "--layouts", "tp2-sp,cp2"])
    assert result.exit_code == 0, result.output
    assert "parity tp2-sp vs 1 rank: ok" in result.output and "parity cp2 vs 1 rank: ok" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["parity_scenarios:correct", "--layouts", "tp2,tp2-xx"],
     "Error: malformed layout 'tp2-xx': bad or repeated part 'xx'; expected parts tp<N>, cp<N>, "
     "dp<N>, ep<N>, etp<N>, pp<N>, sp, e.g. 'tp2-dp2-sp'"),
    (["parity_scenarios:correct", "--layouts", "dp2-sp"], "Error: sequence parallelism (sp) needs tp > 1"),
    (["parity_scenarios"], "Error: expected module:function, got 'parity_scenarios'"),
    (["parity_scenarios:nothing"], "Error: 'parity_scenarios' has no function 'nothing'"),
    (["no_such_module:f"], "Error: cannot import 'no_such_module': No module named 'no_such_module'"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(main, ["parity", *args])
    assert result.exit_code == 2 and result.stderr.strip() == message


IN_PLACE = """
import sys
sys.path.insert(0, {tests!r})
import parity_scenarios
import shardcheck as sc
result = sc.parity(parity_scenarios.tiny_bug, ["tp2", "dp2"], typecheck=False)
print("rank 0:" if result else "other rank:", result and [r.first_divergence for r in result.reports])
"""


@pytest.mark.slow
def test_under_torchrun_parity_runs_in_place_on_the_existing_ranks(tmp_path, capfd):
    script = tmp_path / "in_place.py"
    script.write_text(IN_PLACE.format(tests=str(Path(__file__).parent)))
    result = CliRunner().invoke(main, ["run", "-n", "2", str(script)])
    assert result.exit_code == 0, result.output
    lines = sorted(capfd.readouterr().out.splitlines())
    assert lines == ["other rank: None", "rank 0: ['block.fc2', 'block.fc2']"]
