"""The `shardcheck golden` commands end to end on real files: outputs, exit codes, git mode."""

import base64
import json
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner
from golden_data import A2A, EP8, TOP2, data_root, head, history, plain_series

from shardcheck.cli import main

H100 = head(f"{EP8}/golden_values_dev_dgx_h100.json")
H100_2ND = head(f"{EP8}/golden_values_dev_dgx_h100_2nd.json")
GB200 = head(f"{EP8}/golden_values_dev_dgx_gb200.json")
EP8_CONFIG = head(f"{EP8}/model_config.yaml")


def invoke(*args):
    return CliRunner().invoke(main, ["golden", *map(str, args)])


def test_compare_two_files_prints_megatron_statistic_beside_robust_ones():
    old, new = (
        head(f"{TOP2}/golden_values_dev_dgx_h100_2nd.json"),
        head(f"{TOP2}/golden_values_dev_dgx_h100.json"),
    )
    result = invoke("compare", old, new)
    assert result.exit_code == 0, result.output
    o, n = plain_series(old, "num-zeros"), plain_series(new, "num-zeros")
    steps = sorted(set(o) & set(n))
    signed = sum((o[s] - n[s]) / o[s] for s in steps) / len(steps)
    ratio_of_means = sum(n[s] for s in steps) / sum(o[s] for s in steps)
    row = next(line for line in result.output.splitlines() if "num-zeros" in line and "│" in line)
    assert f"{signed:+.1%} (!)" in row and f"{ratio_of_means:.4f}" in row
    assert "disagrees in sign" in result.output


def test_compare_json_and_markdown():
    data = json.loads(invoke("compare", H100, GB200, "--json").output)
    metrics = {m["metric"]: m for m in data["files"][0]["metrics"]}
    o, n = plain_series(H100, "lm loss"), plain_series(GB200, "lm loss")
    steps = sorted(set(o) & set(n))
    assert metrics["lm loss"]["steps"] == len(steps)
    assert metrics["lm loss"]["ratio_of_means"] == pytest.approx(
        sum(n[s] for s in steps) / sum(o[s] for s in steps)
    )
    markdown = invoke("compare", H100, GB200, "--markdown").output
    assert markdown.count("| num-zeros |") == 1 and "|---|" in markdown


def test_compare_json_lists_every_step_past_each_threshold_and_the_table_stays_short():
    data = json.loads(invoke("compare", H100, H100_2ND, "--json").output)
    metrics = {m["metric"]: m for m in data["files"][0]["metrics"]}
    for name, m in metrics.items():
        o, n = plain_series(H100, name), plain_series(H100_2ND, name)
        steps = [s for s in sorted(set(o) & set(n)) if abs(o[s]) >= 1e-12]
        for level, listed in m["changed_steps"].items():
            want = [
                {"step": s, "old": o[s], "new": n[s]}
                for s in steps
                if abs(n[s] / o[s] - 1) > float(level)
            ]
            assert listed == want, (name, level)
            assert m["share_changed"][level] == pytest.approx(len(want) / len(steps))
    over_20 = [c["step"] for c in metrics["num-zeros"]["changed_steps"]["0.20"]]
    assert len(over_20) == 6 > len(metrics["num-zeros"]["largest"]) == 5
    table = invoke("compare", H100, H100_2ND).output
    line = next(x for x in table.splitlines() if x.strip().startswith("num-zeros: largest"))
    assert line.count("step ") == 3


@pytest.mark.slow  # imports matplotlib and renders three figures
def test_html_report_is_self_contained_with_png_plots(tmp_path):
    out = tmp_path / "report.html"
    result = invoke("compare", H100, H100_2ND, "--html", out)
    assert result.exit_code == 0, result.output
    page = out.read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) >= 2  # num-zeros and the other changed metrics
    assert all(base64.b64decode(img)[:8] == b"\x89PNG\r\n\x1a\n" for img in images)
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing is fetched from elsewhere


def test_compare_directories_matches_by_relative_path(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    for case in (EP8, TOP2):
        shutil.copytree(head(case), old / case)
        shutil.copytree(head(case), new / case)
    target = new / EP8 / "golden_values_dev_dgx_h100.json"
    doc = json.loads(target.read_text())
    doc["lm loss"]["values"] = {k: v * 1.02 for k, v in doc["lm loss"]["values"].items()}
    target.write_text(json.dumps(doc))
    (new / TOP2 / "golden_values_dev_dgx_a100.json").unlink()
    data = json.loads(invoke("compare", old, new, "--json").output)
    changed = [
        (f["file"], m["metric"], m["pattern"])
        for f in data["files"]
        for m in f["metrics"]
        if m["pattern"] != "unchanged"
    ]
    assert changed == [(f"{EP8}/golden_values_dev_dgx_h100.json", "lm loss", "uniform shift")]
    skipped = {f["file"]: f["skipped"] for f in data["files"] if f["skipped"]}
    assert skipped.pop(f"{TOP2}/golden_values_dev_dgx_a100.json") == "only in old"
    empty = sorted(
        p.relative_to(old).as_posix()
        for p in old.rglob("*.json")
        if p.read_text().strip() in ("", "{}")
    )
    assert len(empty) == 2 and sorted(skipped) == empty  # a real 0-byte file and a real {}
    assert sorted(reason.split(": ")[-1] for reason in skipped.values()) == [
        "empty file, no golden values in it",
        "empty object {}, the file records no metrics",
    ]
    table = invoke("compare", old, new).output
    assert "changed metrics" in table and "1 of" in table
    markdown = invoke("compare", old, new, "--markdown").output
    assert "- skipped 1: only in old" in markdown and "- skipped 1: empty file" in markdown


@pytest.fixture
def history_repo(tmp_path):
    """A git repo whose commits are the real history versions of one golden file."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    index = json.loads((data_root() / "history" / "index.json").read_text())
    for entry in sorted((e for e in index if e["case"] == A2A), key=lambda e: e["date"]):
        target = repo / A2A / "golden_values_dev_dgx_h100.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(data_root() / "history" / entry["file"], target)
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", entry["subject"], "--allow-empty"], check=True)
    log = subprocess.run(
        [*git, "log", "--format=%H %s"], capture_output=True, text=True, check=True
    ).stdout
    return repo, {line.split(" ", 1)[1]: line.split(" ", 1)[0] for line in log.splitlines()}


def test_git_revisions_compare_the_te_bump(history_repo):
    repo, commits = history_repo
    bump = commits["build: Bump TE2.13 (#3800)"]
    data = json.loads(
        invoke("compare", "--repo", repo, "--rev", f"{bump}~1", "--rev", bump, "--json").output
    )
    metrics = {m["metric"]: m for m in data["files"][0]["metrics"]}
    old, new = history(A2A, "build: Bump TE2.13")
    o, n = plain_series(old, "num-zeros"), plain_series(new, "num-zeros")
    assert metrics["num-zeros"]["ratio_of_means"] == pytest.approx(
        sum(n.values()) / sum(o.values())
    )
    assert data["files"][0]["file"] == f"{A2A}/golden_values_dev_dgx_h100.json"


def test_git_bad_revision_is_one_line_exit_2(history_repo):
    repo, _ = history_repo
    result = invoke("compare", "--repo", repo, "--rev", "nope", "--rev", "HEAD")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("Error: git rev-parse")


def test_check_exit_codes_and_failing_steps():
    assert invoke("check", H100, H100, "--model-config", EP8_CONFIG).exit_code == 0
    result = invoke("check", H100, GB200, "--model-config", EP8_CONFIG)
    assert result.exit_code == 1
    assert (
        "FAIL num-zeros approximate (rtol 0.2)" in result.output
        and "failing steps: 1," in result.output
    )
    assert invoke("check", H100, head(f"{EP8}/no_such.json")).exit_code == 2


def test_check_resume_uses_the_save_interval_from_the_config():
    result = invoke(
        "check", H100, H100, "--model-config", EP8_CONFIG, "--second-run", H100_2ND, "--json"
    )
    data = json.loads(result.output)
    resume = data["resume: second run vs first run after step 50"]
    first, second = plain_series(H100, "lm loss"), plain_series(H100_2ND, "lm loss")
    differing = [s for s in second if s > 50 and second[s] != first[s]]
    exact = next(
        c for c in resume["checks"] if c["metric"] == "lm loss" and c["kind"] == "deterministic"
    )
    assert exact["failing_steps"] == differing and exact["steps_evaluated"] == 50
    assert result.exit_code == (1 if differing else 0)


def test_compare_resume_step_splits_before_and_after():
    data = json.loads(invoke("compare", H100, GB200, "--resume-step", 50, "--json").output)
    labels = [f["file"] for f in data["files"]]
    assert labels[1].endswith("[steps <= 50]") and labels[2].endswith("[steps > 50]")
    assert [m["steps"] for m in data["files"][1]["metrics"] if m["metric"] == "lm loss"] == [50]


def test_repeats_report_noise_and_tolerance():
    result = invoke(
        "compare",
        H100,
        GB200,
        "--old-repeats",
        H100_2ND,
        "--new-repeats",
        head(f"{EP8}/golden_values_dev_dgx_gb200_2nd.json"),
    )
    assert result.exit_code == 0, result.output
    assert "run-to-run noise" in result.output and "too few runs" in result.output


def test_explain_prints_whole_expert_multiples():
    result = invoke("explain", H100, H100_2ND, "--model-config", EP8_CONFIG)
    assert result.exit_code == 0, result.output
    assert "one expert (fc1 + fc2): 512x1024 + 1024x512 = 1,048,576" in result.output
    assert "step 92: old 2,099,760 = 2 x 1,048,576 + 2,608" in result.output
    assert "gained or lost whole blocks: 58 (+1), 97 (+1)" in result.output


def test_usage_errors_are_one_line():
    for args in (
        ("compare", H100),
        ("compare", H100, data_root()),
        ("explain", H100, H100_2ND, "--model-config", H100),
    ):
        result = invoke(*args)
        assert result.exit_code == 2, args
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_config_nondeterminism_skips_exact_checks_and_counts_unlogged_steps():
    case = "hybrid/hybrid_mr_mcore_te_tp1_pp1_cp1_dgx_a100_1N8G"
    golden_path, actual_path = (
        head(f"{case}/golden_values_dev_dgx_h100.json"),
        head(f"{case}/golden_values_dev_dgx_a100.json"),
    )
    result = invoke(
        "check", golden_path, actual_path, "--model-config", head(f"{case}/model_config.yaml")
    )
    assert (
        "approximate checks only (nondeterminism allowed by the config's ENV_VARS)" in result.output
    )
    assert "deterministic" not in result.output
    golden_steps = json.loads(golden_path.read_text())["num-zeros"]["values"]
    logged = json.loads(actual_path.read_text())["num-zeros"]["values"]
    unlogged = sum(1 for s in golden_steps if not isinstance(logged.get(s), int | float))
    assert f"({unlogged} not logged by the run)" in result.output and result.exit_code == 1
