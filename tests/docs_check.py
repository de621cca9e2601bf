"""The docs check: rerun every shown command of README.md and docs/*.md and compare its output.

A fenced block is checked when the line just before it is an HTML comment (see docs/docs-check.md):

    <!-- docs-check -->             a transcript: each ``$ command`` line runs, in one bash session
                                    per block, and the lines up to the next ``$`` are its output
    <!-- docs-check: slow -->       a transcript run only by ``make docs-check-all``
    <!-- docs-check: unordered -->  ranks print concurrently: lines are compared as a sorted list
    <!-- docs-check: file NAME -->  the block's text is written to NAME for the transcripts after it
    <!-- docs-check: golden -->     a transcript on the real Megatron golden data ($GOLDEN), skipped
                                    where the data is absent
    <!-- docs-check: skip WHY -->   shown but not rerun, for the reason given

Every transcript (a block with a ``$ `` line) must carry one of these comments. Transcripts run
from a scratch folder standing for the repository root (its top-level entries are links to the
checkout's), where ``shardcheck`` and ``python`` are this interpreter. Outputs are normalised
before comparison: paths of the checkout and the scratch folder are dropped, durations become
``<t>``; a line ``...`` in the shown output stands for any lines.

``python tests/docs_check.py [--update] [--slow] FILE...`` prints the differences (or writes the
real outputs back into the files).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- docs-check(?::\s*(?P<args>.*?))?\s*-->$")
FENCE = re.compile(r"^(?P<fence>```+|~~~+)")
SEPARATOR = "@@docs-check-output-ends@@"
DURATION = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|min|h)\b")
HEX = re.compile(r"0x[0-9a-f]{6,}")
COMMAND_TIMEOUT_S = 3000


def golden_data() -> Path | None:
    """$SHARDCHECK_GOLDEN_DATA, else the nearest ancestor's shared/data/megatron-golden."""
    if os.environ.get("SHARDCHECK_GOLDEN_DATA"):
        return Path(os.environ["SHARDCHECK_GOLDEN_DATA"])
    return next((p / "shared" / "data" / "megatron-golden" for p in REPO.parents
                 if (p / "shared" / "data" / "megatron-golden").is_dir()), None)


@dataclass
class Block:
    """One fenced block of a document with its docs-check comment."""

    doc: Path
    line: int  # 1-based line of the opening fence
    args: str | None  # None: no docs-check comment
    lines: list[str]
    start: int  # index in the document's lines of the block's first content line

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def is_transcript(self) -> bool:
        return any(line.startswith("$ ") for line in self.lines)

    @property
    def words(self) -> list[str]:
        return (self.args or "").split()

    @property
    def slow(self) -> bool:
        return "slow" in self.words

    @property
    def skipped(self) -> str | None:
        if self.words[:1] != ["skip"]:
            return None
        return self.args.partition("skip")[2].strip() or "no reason given"

    @property
    def file(self) -> str | None:
        return self.words[1] if self.words[:1] == ["file"] and len(self.words) > 1 else None

    def commands(self) -> list[Command]:
        found: list[Command] = []
        for offset, line in enumerate(self.lines):
            if line.startswith("$ "):
                found.append(Command(line[2:], offset))
            elif found:
                found[-1].expected.append(line)
        return found


@dataclass
class Command:
    text: str
    offset: int  # the line of the block where it stands
    expected: list[str] = field(default_factory=list)


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of a document, each with the docs-check comment just before it."""
    lines = doc.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = next((j for j in range(index + 1, len(lines)) if lines[j].startswith(opening["fence"])), len(lines))
        marker = MARKER.match(lines[index - 1].strip()) if index else None
        found.append(Block(doc, index + 1, (marker["args"] or "") if marker else None,
                           lines[index + 1:end], index + 1))
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for doc in DOCUMENTS for block in blocks(doc)]


def normalise(lines: list[str], roots: tuple[str, ...] = ()) -> list[str]:
    text = "\n".join(lines)
    for root in roots:
        text = text.replace(root + os.sep, "").replace(root, ".")
    text = HEX.sub("0x…", DURATION.sub("<t>", text))
    out = [line.rstrip() for line in text.splitlines()]
    while out and not out[-1]:
        out.pop()
    return out


def matches(expected: list[str], actual: list[str], unordered: bool = False) -> bool:
    """Whether the actual lines are the expected ones (``...`` standing for any lines)."""
    if unordered:
        return sorted(expected) == sorted(actual)
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


class Workspace:
    """A scratch folder standing for the repository root, with ``shardcheck`` on PATH."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="docs-check-")
        self.root = Path(self._tmp.name) / "repo"
        self.root.mkdir()
        for entry in REPO.iterdir():
            if entry.name not in (".git", ".shardcheck", ".venv", "audit-out"):
                (self.root / entry.name).symlink_to(entry)
        bin_dir = Path(self._tmp.name) / "bin"
        bin_dir.mkdir()
        for name, command in (("shardcheck", f'"{sys.executable}" -m shardcheck'), ("python", f'"{sys.executable}"')):
            (bin_dir / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')  # a link would lose the venv
            (bin_dir / name).chmod(0o755)
        self.env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                                           os.environ.get("PATH", "")]),
                    "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
                    "COLUMNS": "160", "TERM": "dumb", "NO_COLOR": "1", "PYTHONHASHSEED": "0",
                    "OMP_NUM_THREADS": "1",  # else torchrun prints a timestamped notice about it
                    "GOLDEN": str(golden_data() or "")}
        self.env.pop("FORCE_COLOR", None)

    def roots(self) -> tuple[str, ...]:
        golden = golden_data()
        return (str(self.root), str(self.root.resolve()), str(REPO), self._tmp.name,
                *([str(golden)] if golden else []))

    def write_files(self, doc_blocks: list[Block], before: Block) -> None:
        for block in doc_blocks:
            if block.file and block.line < before.line:
                (self.root / block.file).write_text("\n".join(block.lines) + "\n")

    def run(self, block: Block) -> list[list[str]]:
        """Each command's output lines, in one bash session (stdout and stderr together)."""
        script = "".join(f"{c.text}\n__rc=$?; echo {SEPARATOR}; (exit $__rc)\n" for c in block.commands())
        proc = subprocess.Popen(["bash", "-c", script], cwd=self.root, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=COMMAND_TIMEOUT_S)
        finally:  # nothing a transcript started outlives it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        outputs = [part.splitlines() for part in done.stdout.split(SEPARATOR + "\n")[:len(block.commands())]]
        if done.stderr.strip() and outputs:  # bash's own complaints, e.g. a syntax error
            outputs[-1] += done.stderr.splitlines()
        return outputs

    def close(self) -> None:
        self._tmp.cleanup()


def check(block: Block, workspace: Workspace) -> list[str]:
    """The differences between what the block shows and what its commands print now."""
    outputs = workspace.run(_joined(block))
    problems = []
    for command, actual in zip(block.commands(), outputs, strict=False):
        want, got = normalise(command.expected), normalise(actual, workspace.roots())
        if not matches(want, got, "unordered" in block.words):
            problems.append(f"$ {command.text}\n--- shown\n" + "\n".join(want) + "\n--- now\n" + "\n".join(got))
    if len(outputs) < len(block.commands()):
        problems.append(f"only {len(outputs)} of {len(block.commands())} commands ran")
    return problems


def _joined(block: Block) -> Block:
    """The block with each command's stderr sent to its stdout, as a terminal shows both."""
    lines = list(block.lines)
    for command in block.commands():
        lines[command.offset] = f"$ {{ {command.text.rstrip(';')} ; }} 2>&1"
    return Block(block.doc, block.line, block.args, lines, block.start)


def _runnable(block: Block, slow: bool) -> bool:
    return block.is_transcript and block.args is not None and block.skipped is None and (slow or not block.slow)


def update(doc: Path, slow: bool = False) -> None:
    """Write the real outputs of the document's checked transcripts (``slow`` ones too) back into it."""
    lines = doc.read_text().splitlines()
    doc_blocks = blocks(doc)
    workspace = Workspace()
    replacements = []
    try:
        for block in [b for b in doc_blocks if _runnable(b, slow)]:
            workspace.write_files(doc_blocks, block)
            outputs = workspace.run(_joined(block))
            new = []
            for command, actual in zip(block.commands(), outputs, strict=False):
                new += [f"$ {command.text}", *_shown(actual, workspace.roots())]
            replacements.append((block, new))
            print(f"{block.name}: {len(outputs)} command(s) rerun", file=sys.stderr)
    finally:
        workspace.close()
    for block, new in reversed(replacements):
        lines[block.start:block.start + len(block.lines)] = new
    doc.write_text("\n".join(lines) + "\n")


def _shown(actual: list[str], roots: tuple[str, ...]) -> list[str]:
    text = "\n".join(actual)
    for root in roots:
        text = text.replace(root + os.sep, "").replace(root, ".")
    out = [line.rstrip() for line in text.splitlines()]
    while out and not out[-1]:
        out.pop()
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    slow = "--slow" in args
    args = [a for a in args if a != "--slow"]
    if args[:1] == ["--update"]:
        for name in args[1:]:
            update(Path(name).resolve(), slow)
    else:
        for name in args:
            space = Workspace()
            for b in blocks(Path(name).resolve()):
                if _runnable(b, slow):
                    space.write_files(blocks(b.doc), b)
                    print(f"== {b.name}", *check(b, space), sep="\n")
            space.close()
