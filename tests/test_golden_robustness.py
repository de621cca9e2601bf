"""Every file under head/ loads, or is rejected with one clear line and exit status 2."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from golden_data import EP8, data_root, full_data_root, head

from shardcheck.cli.golden import golden
from shardcheck.golden.compare import compare_golden
from shardcheck.golden.config import load_model_config
from shardcheck.golden.io import GoldenInputError, load_golden


def classify(path):
    """What the file is, decided with plain json (independent of the loader)."""
    text = path.read_text()
    if not text.strip():
        return "empty"
    doc = json.loads(text)
    if doc == {}:
        return "{}"
    if any(k in doc for k in ("generated_text", "throughput")) or any(
        isinstance(v, dict) and "values" not in v for v in doc.values()
    ):
        return "inference"
    if any(isinstance(v, dict) and isinstance(v["values"], list) for v in doc.values()):
        return "legacy"
    return "training"


def check_every_file(head_dir):
    """Load or reject each file under ``head_dir``; how many files of each kind it held."""
    runner = CliRunner()
    kinds = {}
    for path in sorted(head_dir.rglob("*")):
        if not path.is_file():
            continue
        if path.name == "model_config.yaml":
            assert load_model_config(path).mappings, path
            continue
        kind = classify(path)
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind in ("training", "legacy"):
            loaded = load_golden(path)
            assert loaded.legacy is (kind == "legacy")
            (whole,) = compare_golden(loaded, loaded, path.name)
            assert whole.metrics and all(
                m.pattern in ("unchanged", "zero in both", "no shared steps") for m in whole.metrics
            )
            continue
        result = runner.invoke(golden, ["compare", str(path), str(path)])
        assert result.exit_code == 2, (path, result.output)
        assert isinstance(result.exception, SystemExit)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: "), lines
        assert "Traceback" not in result.output
    return kinds


KINDS = {"training", "legacy", "empty", "{}", "inference"}


def test_every_carried_file_loads_or_is_rejected_in_one_line():
    kinds = check_every_file(data_root() / "head")
    assert set(kinds) == KINDS  # the carried subset holds every format


@pytest.mark.slow
def test_every_file_of_the_full_data_set_loads_or_is_rejected_in_one_line():
    kinds = check_every_file(full_data_root() / "head")
    assert set(kinds) == KINDS and kinds["training"] > 800


def first_file(kind):
    for path in sorted((data_root() / "head").rglob("golden_values*.json")):
        if classify(path) == kind:
            return path
    raise LookupError(kind)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("empty", "empty file"),
        ("{}", "empty object {}"),
        ("inference", "inference golden values"),
    ],
)
def test_each_unusable_kind_has_its_own_reason(kind, reason):
    with pytest.raises(GoldenInputError, match=reason):
        load_golden(first_file(kind))


def test_legacy_lists_load_at_their_documented_steps_and_check_refuses_them():
    path = first_file("legacy")
    raw = json.loads(path.read_text())
    loaded = load_golden(path)
    assert loaded.legacy
    for name, block in raw.items():
        if isinstance(block, dict):
            want = [
                block["start_step"] + i * block["step_interval"]
                for i in range(len(block["values"]))
            ]
            assert loaded.metrics[name].steps.tolist() == want
    result = CliRunner().invoke(golden, ["check", str(path), str(path)])
    assert result.exit_code == 2 and "legacy format" in result.stderr


def test_nan_strings_are_kept_apart_from_numbers():
    path = head(f"{EP8}/golden_values_dev_dgx_h100_2nd.json")
    raw = json.loads(path.read_text())["lm loss"]["values"]
    series = load_golden(path).metrics["lm loss"]
    nan_steps = sorted(int(s) for s, v in raw.items() if v == "nan")
    assert series.steps[series.text].tolist() == nan_steps and len(nan_steps) == 50


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[1, 2]", "top level is a JSON list"),
        ("{not json", "not valid JSON"),
        ('{"lm loss": {"values": {"1": "fast"}}}', "holds the string 'fast'"),
        ('{"lm loss": {"values": {"one": 1.0}}}', "step key 'one' is not an integer"),
        ('{"lm loss": {"start_step": 1}}', "has no 'values'"),
    ],
)
def test_malformed_inputs_get_one_line_reasons(tmp_path, text, reason):
    path = tmp_path / "golden_values.json"
    path.write_text(text)
    result = CliRunner().invoke(golden, ["compare", str(path), str(path)])
    assert result.exit_code == 2
    assert reason in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # the package import pulls in torch
def test_real_process_exits_2_without_traceback(tmp_path):
    empty = tmp_path / "golden_values_empty.json"
    empty.write_text("")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from shardcheck.cli.golden import golden; golden()",
            "check",
            str(empty),
            str(empty),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"Error: {empty}: empty file, no golden values in it"
