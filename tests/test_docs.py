"""The docs check (docs/docs-check.md): every shown transcript is rerun and must match.

Slow transcripts (the Megatron audit, fuzzing Megatron components) run only when
SHARDCHECK_DOCS_ALL=1, as ``make docs-check-all`` sets it.
"""

import os

import pytest
from docs_check import (
    DOCUMENTS,
    REPO,
    Block,
    Command,
    Workspace,
    all_blocks,
    blocks,
    check,
    golden_data,
    matches,
    normalise,
)

ALL = os.environ.get("SHARDCHECK_DOCS_ALL") == "1"
TRANSCRIPTS = [b for b in all_blocks() if b.is_transcript and b.args is not None and b.skipped is None]
_workspaces: dict = {}


@pytest.fixture(scope="module")
def workspaces():
    """One scratch repository root per document: its transcripts run in order and share state."""
    yield _workspaces
    for space in _workspaces.values():
        space.close()
    _workspaces.clear()


def _params():
    for block in TRANSCRIPTS:
        marks = [pytest.mark.timeout(3600)]
        if block.slow:
            marks.append(pytest.mark.skipif(not ALL, reason="slow: make docs-check-all"))
        if "golden" in block.words:
            marks.append(pytest.mark.skipif(golden_data() is None, reason="no megatron-golden data here"))
        yield pytest.param(block, id=block.name, marks=marks)


@pytest.mark.parametrize("block", list(_params()))
def test_shown_output_is_what_the_command_prints(block: Block, workspaces):
    space = workspaces.setdefault(block.doc, Workspace())
    space.write_files(blocks(block.doc), block)
    problems = check(block, space)
    assert not problems, f"{block.name} drifted:\n" + "\n\n".join(problems)


def test_every_transcript_is_marked_checked_slow_or_skipped_with_a_reason():
    unmarked = [b.name for b in all_blocks() if b.is_transcript and b.args is None]
    assert unmarked == [], "transcripts without a docs-check comment (see docs/docs-check.md)"
    assert all(b.skipped != "no reason given" for b in all_blocks())
    assert DOCUMENTS and len(TRANSCRIPTS) >= 10


def test_a_file_block_named_after_an_example_is_that_example():
    for block in (b for b in all_blocks() if b.file):
        example = REPO / "docs" / "examples" / block.file
        if example.exists():
            assert "\n".join(block.lines) + "\n" == example.read_text(), block.name


def test_an_edited_pasted_output_fails_the_check(tmp_path):
    """The check itself: a real transcript passes as shown and fails once its output is edited."""
    doc = tmp_path / "doc.md"
    shown = ["$ shardcheck run missing.py", "Error: no such script: missing.py", "$ echo $?", "2"]
    doc.write_text("\n".join(["<!-- docs-check -->", "```", *shown, "```", ""]))
    space = Workspace()
    try:
        [block] = blocks(doc)
        assert check(block, space) == []
        edited = tmp_path / "edited.md"
        edited.write_text(doc.read_text().replace("Error: no such script", "Error: no such file"))
        [problem] = check(blocks(edited)[0], space)
        assert "Error: no such file: missing.py" in problem and "Error: no such script: missing.py" in problem
        exit_edited = tmp_path / "exit.md"
        exit_edited.write_text(doc.read_text().replace("\n2\n", "\n0\n"))
        assert len(check(blocks(exit_edited)[0], space)) == 1
    finally:
        space.close()


def test_normalising_drops_timings_and_checkout_paths_only():
    assert normalise(["12 examples in 1.6 s", "took 3 min 4 s", "/repo/x/tests/a.py:3  "], ("/repo/x",)) == [
        "12 examples in <t>", "took <t> <t>", "tests/a.py:3"]
    assert normalise(["loss 2.25", "rank 1"]) == ["loss 2.25", "rank 1"]


def test_an_ellipsis_line_stands_for_any_lines_and_nothing_else():
    assert matches(["a", "...", "z"], ["a", "b", "c", "z"])
    assert matches(["a", "...", "z"], ["a", "z"])
    assert not matches(["a", "...", "z"], ["a", "b"])
    assert not matches(["a", "b"], ["a", "c"])
    assert matches(["b", "a"], ["a", "b"], unordered=True) and not matches(["b", "a"], ["a", "b"])


def test_commands_and_their_outputs_are_read_from_a_block():
    block = Block(DOCUMENTS[0], 1, "", ["$ one", "out 1", "out 2", "$ two"], 0)
    assert [(c.text, c.expected) for c in block.commands()] == [("one", ["out 1", "out 2"]), ("two", [])]
    assert isinstance(block.commands()[0], Command)
