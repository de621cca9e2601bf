"""The docs check (docs/docs-check.md): every shown transcript is rerun and must match.

A transcript or output that is not rerun is a dated example; an audit's is checked against the
findings.json of its run, carried in the repository.
"""

import json
import os
import re

import pytest
from docs_check import (
    DOCUMENTS,
    REPO,
    Block,
    Command,
    Workspace,
    all_blocks,
    audit_differences,
    audit_of_findings,
    blocks,
    check,
    golden_data,
    is_excerpt,
    matches,
    normalise,
    shown_audit,
)

TRANSCRIPTS = [b for b in all_blocks() if b.rerun]
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
        if block.megatron is not None:
            marks.append(pytest.mark.skipif(not block.megatron.is_dir(), reason=f"no {block.megatron} here"))
        if "golden" in block.words:
            marks.append(pytest.mark.skipif(golden_data() is None, reason="no megatron-golden data here"))
        yield pytest.param(block, id=block.name, marks=marks)


@pytest.mark.parametrize("block", list(_params()))
def test_shown_output_is_what_the_command_prints(block: Block, workspaces):
    space = workspaces.setdefault(block.doc, Workspace())
    space.write_files(blocks(block.doc), block)
    problems = check(block, space)
    assert not problems, f"{block.name} drifted:\n" + "\n\n".join(problems)


def _unlabelled(block: Block) -> bool:
    """A transcript not rerun, or an output without a ``$`` line and without a reason, that is not dated."""
    shown = (block.is_transcript and not block.rerun) or (block.looks_like_output and block.skipped is None)
    return shown and block.dated is None


def test_every_transcript_is_marked_checked_or_skipped_with_a_reason():
    unmarked = [b.name for b in all_blocks() if b.is_transcript and b.args is None]
    assert unmarked == [], "transcripts without a docs-check comment (see docs/docs-check.md)"
    assert all(b.skipped != "no reason given" for b in all_blocks())
    assert [b.name for b in all_blocks() if "slow" in b.words] == [], "every transcript runs in CI: no 'slow'"
    assert DOCUMENTS and len(TRANSCRIPTS) >= 10


def test_every_transcript_not_rerun_and_every_pasted_output_is_dated_or_excused():
    """Not rerun (``skip``, ``example``, or an output without a ``$`` line): an 'Example from' line."""
    unlabelled = [b.name for b in all_blocks() if _unlabelled(b)]
    assert unlabelled == [], ("transcripts not rerun or outputs without a $ line, and without a visible "
                              "'Example from YYYY-MM-DD, commit C' line (or, for an output, a 'docs-check: "
                              "skip WHY' comment): docs/docs-check.md")


def test_an_output_block_is_told_from_code_and_needs_its_date(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("Output:\n\n```\nok\n```\n\n```python\nx = 1\n```\n\nExample from 2026-12-06, commit "
                   "6e56eeb:\n\n```text\nok\n```\n\n<!-- docs-check: file a.py -->\n```\nx = 1\n```\n")
    plain, code, dated, saved = blocks(doc)
    assert plain.looks_like_output and plain.dated is None
    assert not code.looks_like_output and not saved.looks_like_output
    assert dated.looks_like_output and dated.dated["date"] == "2026-12-06" and dated.dated["commit"] == "6e56eeb"
    assert _unlabelled(plain) and not any(map(_unlabelled, (code, dated, saved)))


def test_every_audit_example_shows_the_counts_and_findings_of_its_findings_json():
    examples = [b for b in all_blocks() if b.example]
    assert len(examples) >= 2, "README.md's and docs/audit.md's default audit outputs"
    for block in examples:
        assert block.dated is not None, f"{block.name}: an example needs its 'Example from' line"
        assert audit_differences(block) == [], block.name


def test_an_edited_count_or_title_of_an_audit_example_fails(tmp_path):
    [block] = [b for b in all_blocks() if b.example][:1]
    real = audit_of_findings(json.loads((REPO / block.example / "findings.json").read_text()))
    assert shown_audit(block.lines)["counts"] == real["counts"]
    first = next(i for i, line in enumerate(block.lines) if line.startswith("audit: "))
    edited = Block(block.doc, block.line, block.args, list(block.lines), block.start)
    edited.lines[first] = edited.lines[first].replace(" cases run", "0 cases run", 1)
    assert any(p.startswith("counts:") for p in audit_differences(edited))
    titled = next(i for i, line in enumerate(block.lines) if line.startswith("[1] "))
    edited.lines[titled + 1] += " (edited)"
    assert any(p.startswith("[1] title") for p in audit_differences(edited))


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


def test_a_megatron_version_block_imports_that_overlay_first(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- docs-check: megatron 0.16.1 -->\n```\n$ true\n```\n")
    [block] = blocks(doc)
    space = Workspace()
    try:
        assert block.megatron == REPO / ".venv" / "megatron-core-0.16.1"
        assert space.block_env(block)["PYTHONPATH"].split(os.pathsep)[:2] == [str(block.megatron), str(REPO)]
    finally:
        space.close()


def test_a_copy_of_a_transcript_rerun_elsewhere_is_an_excerpt_of_it():
    """A block skipped as 'rerun in PAGE' shows lines of the transcript of PAGE with the same command, in order."""
    copies = [b for b in all_blocks() if b.skipped and re.search(r"rerun in \S+\.md", b.skipped)]
    assert copies, "README.md's train example"
    for copy in copies:
        page = REPO / re.search(r"rerun in (\S+\.md)", copy.skipped)[1]
        [original] = [b for b in blocks(page) if b.rerun and b.lines[:1] == copy.lines[:1]]
        assert is_excerpt(copy.lines, original.lines), copy.name
