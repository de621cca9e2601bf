"""The command line's error contract, walked command by command: bad input exits 2 with one
``Error:`` line on stderr and no traceback (shardcheck.cli.errors)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardcheck.cli import main
from shardcheck.fuzz.findings import Finding, FindingStore

SCENARIOS = '''
import torch

def tensor_out(ctx, n=2):
    return torch.ones(n)

def raises(ctx, n=2):
    raise ValueError("my scenario is broken")
'''


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """A folder with a scenario module, a golden-values file, an empty findings store, stores
    with a record that is not JSON (corrupt) or lacks fields (partial), one with a good record
    (valid), and a regular file where commands are told to write a folder (afile)."""
    (tmp_path / "bad_scenarios.py").write_text(SCENARIOS)
    series = {"start_step": 1, "end_step": 3, "step_interval": 1, "values": {"1": 2.0, "2": 1.5, "3": 1.25}}
    (tmp_path / "golden.json").write_text(json.dumps({"lm loss": series}))
    (tmp_path / "script.py").write_text("print('hello')\n")
    (tmp_path / "afile").write_text("a file, not a folder\n")
    for store, text in (("corrupt", "{not json"), ("partial", '{"title": "t", "target": "x"}')):
        (tmp_path / store / "findings").mkdir(parents=True)
        (tmp_path / store / "findings" / "0123456789.json").write_text(text)
    FindingStore(tmp_path / "valid").save(Finding("t", "bad_scenarios:tensor_out", "bad_scenarios.py:4", "parity",
                                                  "tp2", {}, 1.0, 2.0, id="abcdef0123"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


BAD_INPUTS = [
    (["nope"], "No such command 'nope'"),
    (["run", "missing.py"], "no such script: missing.py"),
    (["run", "--nprocs", "2", "script.py"], "no such option: --nprocs (options go before SCRIPT"),
    (["run", "-n", "0", "script.py"], "--nproc and --timeout must be positive"),
    (["run", "--timeout", "soon", "script.py"], "Invalid value for '--timeout'"),
    (["run"], "Missing argument 'SCRIPT'"),
    (["parity", "nocolon"], "expected module:function, got 'nocolon'"),
    (["parity", "no_such_module:f"], "cannot import 'no_such_module'"),
    (["parity", "bad_scenarios:missing"], "'bad_scenarios' has no function 'missing'"),
    (["parity", "bad_scenarios:tensor_out", "--layouts", "tp3x"], "malformed layout 'tp3x'"),
    (["parity", "bad_scenarios:tensor_out", "--layouts", "tp2"],
     "scenario tensor_out returned a Tensor, expected a dict of output name -> tensor"),
    (["parity", "bad_scenarios:tensor_out", "--timeout", "0"], "Invalid value for '--timeout'"),
    (["parity", "bad_scenarios:tensor_out", "--timeout", "-5"], "Invalid value for '--timeout'"),
    (["parity", "bad_scenarios:tensor_out", "--noise-runs", "-1"], "Invalid value for '--noise-runs'"),
    (["fuzz", "no-such-target"], "unknown fuzz target 'no-such-target'"),
    (["fuzz", "no_such_module:f"], "cannot import 'no_such_module'"),
    (["fuzz", "bad_scenarios:tensor_out", "--budget", "0"], "Invalid value for '--budget'"),
    (["fuzz", "bad_scenarios:tensor_out", "--budget", "2", "--root", "store"],
     "scenario tensor_out returned a Tensor, expected a dict of output name -> tensor"),
    (["repro", "0123456789", "--root", "store"], "no finding with id '0123456789'"),
    (["findings", "--launcher", "mpirun"], "Invalid value for '--launcher'"),
    (["fuzz", "bad_scenarios:tensor_out", "--root", "afile/store"], "cannot write to afile/store: "),
    (["findings", "--root", "corrupt"],
     "corrupt findings store entry corrupt/findings/0123456789.json: not valid JSON"),
    (["findings", "--no-run", "--root", "partial"], "corrupt findings store entry partial/findings/0123456789.json: "
     "missing field(s) location, contract, layout, config, observed, reference"),
    (["repro", "0123", "--root", "corrupt"], "corrupt findings store entry corrupt/findings/0123456789.json"),
    (["repro", "abcdef0123", "--root", "valid", "-o", "afile/repro.py"], "cannot write to afile: "),
    (["audit", "--budget", "3", "--time-limit", "1"], "give --budget or --time-limit, not both"),
    (["audit", "--budget", "0"], "Invalid value for '--budget'"),
    (["audit", "--shard", "3/2"], "--shard '3/2' is not K/N with 1 <= K <= N"),
    *[(["audit", "--only", "output_loss", "--layouts", "tp2", "--set", "label_smoothing=0.1", *where], message)
      for where, message in [(["--out", "afile/out"], "cannot write to afile/out: "),
                             (["--root", "afile/store"], "cannot write to afile/store/findings: ")]],
    (["audit", "merge"], "Missing argument 'DIRS...'"),
    (["audit", "merge", "nowhere"], "nowhere: no share.pkl (run `shardcheck audit --shard K/N --out DIR` first)"),
    *[(["audit", "--only", component, "--layouts", "tp2", "--set", option], message)
      for component, option, message in [  # checked against megatron-core's fields
        ("output_loss", "label_smoothing=abc", "output_loss's label_smoothing takes a number, not 'abc'"),
        ("output_loss", "parallel_output=2", "output_loss's parallel_output takes true or false, not 2"),
        ("output_loss", "hidden_size=8", "output_loss has no option 'hidden_size'"),
        ("gpt", "no_such_field=1", "gpt has no option 'no_such_field': not a field of its setup"),
        ("gpt", "normalization=Norm", "gpt's normalization takes one of 'LayerNorm', 'RMSNorm', not 'Norm'"),
        ("gpt", "attention_backend=fastest", "gpt's attention_backend takes one of "),  # an Enum's names
    ]],
    (["golden", "check", "golden.json", "missing.json"], "missing.json"),
    (["golden", "compare", "golden.json", "golden.json", "--metric", "lm-loss"],
     "no metric 'lm-loss' in the compared files; they have: lm loss"),
    (["golden", "compare", "golden.json"], "give OLD and NEW"),
    (["golden", "compare", "golden.json", "golden.json", "--html", "afile/report.html"],
     "cannot write afile/report.html: Not a directory"),
    (["golden", "explain", "golden.json", "golden.json"], "Missing option '--model-config'"),
    (["train", "--", "--num-layers", "2"], "give -n N (the ranks of the parallel run) or --model-config"),
    (["train", "-n", "0"], "Invalid value for '-n' / '--nproc'"),
    (["train", "-n", "2", "--megatron", "."], "--megatron .: no megatron/core package in it"),
    (["train", "-n", "2", "--", "layers"], "unexpected argument 'layers': Megatron flags start with --"),
    (["train", "-n", "2", "--", "--no-such-flag"], "unknown Megatron flag --no-such-flag"),
    (["train", "-n", "3", "--", "--tensor-model-parallel-size", "2"], "-n 3 is not a multiple of tp*pp*cp = 2"),
    (["train", "-n", "2", "--", "--fp8-format", "e4m3"], "--fp8-format cannot run on a CPU: FP8 needs Transformer Engine"),
    (["train", "-n", "2", "--", "--num-layers", "2"], "give --micro-batch-size: Megatron has no default for it"),
    (["train", "-n", "2", "--steps", "3", "--resume-at", "3", "--", "--micro-batch-size", "1"],
     "--resume-at 3 must be before the last step (3)"),
    (["train", "-n", "2", "--out", "afile/out", "--", "--micro-batch-size", "1"], "cannot write to afile/out: "),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_error_line(args, message, inputs):
    if "--set" in args or args[0] == "train":  # checked against megatron-core's fields, Megatron's flags
        pytest.importorskip("megatron.core")
    if args[0] == "train" and "-n" in args and args[-1] != "." and not _training_imports():
        pytest.skip("megatron.training of another release (see the test below)")
    result = CliRunner().invoke(main, args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not (inputs / "audit-out").exists()  # refused before any audit case ran


def test_a_scenario_that_raises_is_a_harness_failure_with_its_own_traceback_first(inputs):
    result = CliRunner().invoke(main, ["parity", "bad_scenarios:raises", "--layouts", "tp2"])
    assert result.exit_code == 2
    first, *rest = result.stderr.strip().splitlines()
    assert first == ("Error: the one-rank reference of bad_scenarios:raises failed: rank 0 raised "
                     "ValueError: my scenario is broken")
    assert 'bad_scenarios.py", line 8, in raises' in "\n".join(rest)


def test_a_bug_in_shardcheck_exits_2_with_its_traceback(inputs):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    code = ("import importlib, sys; from shardcheck.cli import main; r = importlib.import_module('shardcheck.cli.run'); "
            "r.run_script = lambda *a: 1 / 0; sys.argv = ['shardcheck', 'run', 'script.py']; main()")
    done = subprocess.run([sys.executable, "-c", code], cwd=inputs, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "ZeroDivisionError" in done.stderr and "Traceback" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("Error: shardcheck failed")


def test_found_and_clean_keep_their_exit_codes(inputs):
    assert CliRunner().invoke(main, ["golden", "compare", "golden.json", "golden.json"]).exit_code == 0
    assert CliRunner().invoke(main, ["--help"]).exit_code == 0
    assert CliRunner().invoke(main, ["findings", "--no-run", "--root", "store"]).exit_code == 0


@pytest.fixture(scope="module")
def planted_store(tmp_path_factory):
    """A store with the planted masked-mean bug's finding and its repro script, fuzzed once."""
    root = tmp_path_factory.mktemp("planted") / "store"
    found = CliRunner().invoke(main, ["fuzz", "planted.targets:masked_mean", "--seed", "0", "--budget", "30",
                                      "--root", str(root)])
    assert found.exit_code == 1, found.output
    return root


def test_findings_exits_1_while_a_stored_finding_reproduces(planted_store):
    result = CliRunner().invoke(main, ["findings", "--root", str(planted_store)])
    assert result.exit_code == 1, result.output
    assert "reproduces" in result.output
    assert CliRunner().invoke(main, ["findings", "--no-run", "--root", str(planted_store)]).exit_code == 0


def test_findings_exits_0_once_no_stored_finding_reproduces(planted_store, monkeypatch):
    monkeypatch.setenv("PLANTED_FIXES", "masked_mean_loss")  # the scripts' ranks run the fixed code
    result = CliRunner().invoke(main, ["findings", "--root", str(planted_store)])
    assert result.exit_code == 0, result.output
    assert "fixed" in result.output and "reproduces" not in result.output


def _training_imports() -> bool:
    from shardcheck.megatron.train.args import TrainInputError, megatron_parser

    try:
        megatron_parser()
    except TrainInputError:
        return False
    return True


def test_train_with_a_megatron_training_of_another_release_is_one_line():
    """megatron-core 0.16.1 first on the path, 0.19's megatron.training after it (the CI's
    0.16.1 pass): `train` names the mismatch in one line, exit 2."""
    pytest.importorskip("megatron.core")
    if _training_imports():
        pytest.skip("megatron.training imports with this megatron-core")
    result = CliRunner().invoke(main, ["train", "-n", "2", "--", "--num-layers", "2"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "megatron.training does not import" in lines[0], result.stderr
