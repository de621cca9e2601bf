"""Finding ids name a root cause: the same from any checkout, distinct for distinct causes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardcheck.fuzz.campaign import register_fuzz_target
from shardcheck.fuzz.findings import Finding, FindingStore, finding_id, package_location

REPO = Path(__file__).resolve().parents[1]


def _checkout(where: Path) -> Path:
    """A copy of the planted bugs inside a project folder of its own (marked by pyproject.toml)."""
    (where / "tests").mkdir(parents=True)
    (where / "pyproject.toml").write_text("[project]\nname = 'copy'\n")
    shutil.copytree(REPO / "tests" / "planted", where / "tests" / "planted")
    return where


def _fuzz_in(checkout: Path, root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(checkout / "tests")])}
    done = subprocess.run([sys.executable, "-m", "shardcheck", "fuzz", "planted.targets:masked_mean",
                           "--seed", "0", "--budget", "20", "--root", str(root)],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    [record] = (root / "findings").glob("*.json")
    return json.loads(record.read_text())


@pytest.mark.slow
def test_the_same_finding_from_two_checkouts_in_different_folders_has_one_id(tmp_path):
    first = _fuzz_in(_checkout(tmp_path / "a" / "proj"), tmp_path / "store-a")
    second = _fuzz_in(_checkout(tmp_path / "elsewhere" / "deeper" / "clone"), tmp_path / "store-b")
    assert first["location"] != second["location"]  # absolute paths of two different checkouts
    assert first["location"].endswith("tests/planted/bugs.py:31")
    assert first["id"] == second["id"] == finding_id("tests/planted/bugs.py:31", first["contract"])


@pytest.mark.parametrize("location, relative", [
    ("/usr/lib/python3/site-packages/megatron/core/tensor_parallel/cross_entropy.py:154",
     "megatron/core/tensor_parallel/cross_entropy.py:154"),
    ("/work/venvs/m0161/megatron/core/transformer/moe/router.py:88",
     "megatron/core/transformer/moe/router.py:88"),
    ("/opt/venv/lib/python3.11/site-packages/torch/nn/functional.py:10", "torch/nn/functional.py:10"),
    ("megatron/core/models/gpt/gpt_model.py:3", "megatron/core/models/gpt/gpt_model.py:3"),
    ("moe_router output probs", "moe_router output probs"),
])
def test_locations_are_taken_relative_to_their_package(location, relative):
    assert package_location(location) == relative


def test_a_file_outside_any_project_is_named_by_its_file_alone(tmp_path):
    script = tmp_path / "loose" / "train.py"
    script.parent.mkdir()
    script.write_text("")
    assert package_location(f"{script}:7") == "train.py:7"


def _planted_site(ctx, smoothing=False, gather_output=False, tokens=2):
    return {}


def test_two_bugs_at_one_call_site_with_different_triggers_have_two_ids(tmp_path):
    """The store once overwrote the label-smoothing finding with the runtime_gather_output one:
    same file:line and contract, different option. Their option names now tell them apart."""
    target = register_fuzz_target("test-two-causes-one-site", _planted_site)
    site = "/x/site-packages/megatron/core/tensor_parallel/cross_entropy.py:154"
    contract = "output loss matches the one-rank reference"
    smoothing = Finding("smoothing", target.name, site, contract, "tp2",
                        {"smoothing": True, "tokens": 4}, 1.0, 2.0,
                        options=target.option_names({"smoothing": True, "tokens": 4}))
    gather = Finding("gather", target.name, site, contract, "tp2",
                     {"gather_output": True, "tokens": 2}, 1.0, 2.0,
                     options=target.option_names({"gather_output": True, "smoothing": False, "tokens": 2}))
    assert smoothing.options == ["smoothing"] and gather.options == ["gather_output"]
    assert smoothing.id != gather.id
    store = FindingStore(tmp_path)
    assert store.save(smoothing) and store.save(gather)
    assert sorted(f.title for f in store.all()) == ["gather", "smoothing"]


def test_sizes_are_not_part_of_the_cause():
    target = register_fuzz_target("test-sizes-not-cause", _planted_site)
    assert target.option_names({"tokens": 8, "smoothing": True}) == ["smoothing"]
    assert target.option_names({"tokens": 2, "smoothing": False}) == []


def test_the_store_never_replaces_another_cause_under_a_taken_id(tmp_path):
    store = FindingStore(tmp_path)
    first = Finding("first", "t", "megatron/core/a.py:1", "c", "tp2", {}, 1, 2)
    store.save(first)
    impostor = Finding("second", "t", "megatron/core/b.py:2", "d", "tp2", {}, 1, 2, id=first.id)
    assert store.save(impostor)  # new: kept beside the first, under a longer id
    assert impostor.id != first.id and impostor.id.startswith(impostor.cause[:10])
    assert store.load(first.id).title == "first" and store.load(impostor.id).title == "second"
    titles = {f.id: f.title for f in store.all()}
    assert titles == {first.id: "first", impostor.id: "second"}


def test_the_same_cause_found_again_replaces_its_record(tmp_path):
    store = FindingStore(tmp_path)
    assert store.save(Finding("old", "t", "megatron/core/a.py:1", "c", "tp2", {"x": True}, 1, 2, options=["x"]))
    again = Finding("new", "t", "megatron/core/a.py:1", "c", "dp2", {"x": True}, 3, 4, options=["x"])
    assert not store.save(again)
    assert [f.title for f in store.all()] == ["new"]
