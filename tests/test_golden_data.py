"""The golden data the repository carries: copies of the full data set, small, documented."""

import pytest
from golden_data import CARRIED, ENV, find_full_data, full_data_root, history_index

CARRIED_FILES = sorted(p.relative_to(CARRIED) for p in CARRIED.rglob("*") if p.is_file())


def test_carried_subset_is_small_and_its_readme_names_every_folder():
    assert sum((CARRIED / p).stat().st_size for p in CARRIED_FILES) < 2**20
    readme = (CARRIED / "README.md").read_text()
    case_folders = {p.parent for p in CARRIED_FILES if p.parts[0] == "head"}
    assert case_folders and all(
        f"`{f.relative_to('head').as_posix()}`" in readme for f in case_folders
    )
    history_cases = {
        p.parent.relative_to("history") for p in CARRIED_FILES if p.parts[0] == "history"
    }
    assert all(f"`{c.as_posix()}`" in readme for c in history_cases if c.as_posix() != ".")


def test_every_carried_history_file_is_in_the_index():
    indexed = {e["file"] for e in history_index(CARRIED)}
    carried = {
        p.relative_to("history").as_posix()
        for p in CARRIED_FILES
        if p.parts[0] == "history" and p.name != "index.json"
    }
    assert carried and carried <= indexed


def test_carried_files_are_unchanged_copies_of_the_full_data_set():
    full = full_data_root()
    for rel in CARRIED_FILES:
        if rel.as_posix() == "README.md":
            continue
        assert (CARRIED / rel).read_bytes() == (full / rel).read_bytes(), rel


def test_carried_case_folders_are_whole():
    full = full_data_root()
    for folder in {p.parent for p in CARRIED_FILES if p.parts[0] == "head"}:
        assert sorted(p.name for p in (CARRIED / folder).iterdir()) == sorted(
            p.name for p in (full / folder).iterdir()
        ), folder


def test_the_environment_variable_selects_the_full_data(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(CARRIED))
    assert find_full_data() == CARRIED
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="has no head/ folder"):
        find_full_data()
