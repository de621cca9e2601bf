"""The docs check: rerun every shown command of README.md and docs/*.md and compare its output.

A fenced block is checked when the line just before it is an HTML comment (see docs/docs-check.md):

    <!-- docs-check -->             a transcript: each ``$ command`` line runs, in one bash session
                                    per block, and the lines up to the next ``$`` are its output
    <!-- docs-check: megatron 0.16.1 -->  a transcript run on the megatron-core 0.16.1 overlay
                                    (.venv/megatron-core-0.16.1), skipped where it is absent
    <!-- docs-check: unordered -->  ranks print concurrently: lines are compared as a sorted list
    <!-- docs-check: file NAME -->  the block's text is written to NAME for the transcripts after it
    <!-- docs-check: golden -->     a transcript on the real Megatron golden data ($GOLDEN), skipped
                                    where the data is absent
    <!-- docs-check: example DIR -->  an audit's output from a past run, not rerun: its counts and
                                    findings are compared with DIR/findings.json of that run
    <!-- docs-check: skip WHY -->   shown but not rerun, for the reason given

Every transcript (a block with a ``$ `` line) must carry one of these comments, and one that is
not rerun must be a dated example: a visible line "Example from YYYY-MM-DD, commit abc1234" just
above it. An output without a ``$`` line (a fenced block with no language tag, or ``text``)
needs a comment with a reason or that dated line. Transcripts run
from a scratch folder standing for the repository root (its top-level entries are links to the
checkout's), where ``shardcheck`` and ``python`` are this interpreter. Outputs are normalised
before comparison: paths of the checkout and the scratch folder are dropped, durations become
``<t>``; a line ``...`` in the shown output stands for any lines.

``python tests/docs_check.py [--update] FILE...`` prints the differences (or writes the
real outputs back into the files).
"""

from __future__ import annotations

import contextlib
import json
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
OUTPUT_TAGS = ("", "text", "console", "output")
DATED = re.compile(r"Example from (?P<date>\d{4}-\d{2}-\d{2}), commit (?P<commit>[0-9a-f]{7,40})\b")
MEGATRON_OVERLAYS = {"0.16.1": REPO / ".venv" / "megatron-core-0.16.1"}


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
    tag: str = ""  # the fence's language tag
    prose: list[str] = field(default_factory=list)  # the lines above it, up to the previous block

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
    def looks_like_output(self) -> bool:
        """Not a transcript, not code with a language tag, not a ``file`` block: a pasted output."""
        return not self.is_transcript and self.tag in OUTPUT_TAGS and self.file is None

    @property
    def dated(self) -> re.Match | None:
        """The visible "Example from DATE, commit C" line above the block."""
        return next(filter(None, map(DATED.search, reversed(self.prose))), None)

    @property
    def example(self) -> str | None:
        """The folder of the findings.json behind an ``example DIR`` block."""
        return self.words[1] if self.words[:1] == ["example"] and len(self.words) > 1 else None

    @property
    def megatron(self) -> Path | None:
        """The megatron-core overlay a ``megatron VERSION`` transcript runs on."""
        if self.words[:1] != ["megatron"] or len(self.words) < 2:
            return None
        return MEGATRON_OVERLAYS.get(self.words[1], REPO / ".venv" / f"megatron-core-{self.words[1]}")

    @property
    def rerun(self) -> bool:
        return self.is_transcript and self.args is not None and self.skipped is None and self.example is None

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
    found, index, previous_end = [], 0, 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = next((j for j in range(index + 1, len(lines)) if lines[j].startswith(opening["fence"])), len(lines))
        marker = MARKER.match(lines[index - 1].strip()) if index else None
        found.append(Block(doc, index + 1, (marker["args"] or "") if marker else None,
                           lines[index + 1:end], index + 1, lines[index][len(opening["fence"]):].strip(),
                           lines[previous_end:index]))
        index = previous_end = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for doc in DOCUMENTS for block in blocks(doc)]


AUDIT_LINE = re.compile(r"^audit: (\d+) cases run, (\d+) failed to run, (\d+) options not swept")
VERDICT_LINE = re.compile(r"^(\d+) finding\(s\) confirmed by parity, (\d+) type-only(?:, (\d+) crash\(es\))?")
FINDING_LINE = re.compile(r"^\[(\d+)\] ([0-9a-f]{10}) (\S+)  (.*)$")
FIELDS = ("trigger:", "effect:", "checker:", "corrected control:", "reproduce:", "script:")
SHOWED = "where it showed:"  # a finding located at its root names where it showed first


def shown_audit(lines: list[str]) -> dict:
    """What a pasted audit output claims: its counts and each finding's number, id, kind, location, title."""
    counts = next((m.groups() for m in map(AUDIT_LINE.match, lines) if m), ())
    verdict = next((m.groups() for m in map(VERDICT_LINE.match, lines) if m), ())
    findings = []
    for index, line in enumerate(lines):
        if match := FINDING_LINE.match(line):
            after = index + 1
            while after < len(lines) and lines[after].strip().startswith(SHOWED):  # before the title
                after += 1
            title = lines[after].strip() if after < len(lines) else ""
            untitled = match[3] == "type-only" or not lines[after].startswith("    ") or title.startswith(FIELDS)
            location = match[4].rsplit("  (", 1)[0] if match[3] == "type-only" else match[4]
            findings.append({"n": int(match[1]), "id": match[2], "kind": match[3], "location": location,
                             "title": None if untitled else title})
    return {"counts": [int(c) for c in counts],
            "verdict": [int(v or 0) for v in verdict], "findings": findings}


def audit_of_findings(data: dict) -> dict:
    """The same claims, from an audit's findings.json, numbered as ``shardcheck audit`` prints them."""
    summary, found = data["summary"], data["findings"]
    order = [f for f in found if f["kind"] not in ("type-only", "crash")]
    order += [f for f in found if f["kind"] == "crash"] + [f for f in found if f["kind"] == "type-only"]
    counts = [summary["cases run"], summary["cases failed to run"], summary["options not swept"]]
    kinds = [sum(f["kind"] not in ("type-only", "crash") for f in found),
             sum(f["kind"] == "type-only" for f in found), sum(f["kind"] == "crash" for f in found)]
    return {"counts": counts, "verdict": kinds, "findings": [
        {"n": n, "id": f["id"], "kind": f["kind"], "title": f["title"],
         "location": f["location"] if f["kind"] != "type-only" else f["checker"]} for n, f in enumerate(order, 1)]}


def audit_differences(block: Block) -> list[str]:
    """Where an ``example DIR`` block's output differs from DIR/findings.json of its run."""
    shown, real = shown_audit(block.lines), audit_of_findings(json.loads((REPO / block.example / "findings.json").read_text()))
    problems = [f"{what}: shown {shown[what]}, findings.json {real[what]}"
                for what in ("counts", "verdict") if shown[what] != real[what]]
    by_n = {f["n"]: f for f in real["findings"]}
    for finding in shown["findings"]:
        want = by_n.get(finding["n"], {})
        problems += [f"[{finding['n']}] {key}: shown {finding[key]!r}, findings.json {want.get(key)!r}"
                     for key in ("id", "kind", "location", "title")
                     if finding[key] is not None and finding[key] != want.get(key)]
    if not shown["counts"] or not shown["verdict"]:
        problems.append("no 'audit: N cases run' line or no 'N finding(s) confirmed' line")
    output = REPO / block.example / "output.txt"
    shown_lines = [line for line in block.lines if not line.startswith("$ ") and line != "..."]
    if output.exists() and not is_excerpt(normalise(shown_lines), normalise(output.read_text().splitlines())):
        problems.append(f"the shown lines are not, in their order, lines of {block.example}/output.txt")
    return problems


def is_excerpt(shown: list[str], output: list[str]) -> bool:
    """Whether every shown line is a line of the output, in the output's order (whole lines left out)."""
    lines = iter(output)
    return all(any(line == real for real in lines) for line in shown)


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

    def block_env(self, block: Block) -> dict[str, str]:
        """The environment of a block: a ``megatron VERSION`` one imports that overlay first."""
        if block.megatron is None:
            return self.env
        return {**self.env, "PYTHONPATH": os.pathsep.join([str(block.megatron), self.env["PYTHONPATH"]])}

    def run(self, block: Block) -> list[list[str]]:
        """Each command's output lines, in one bash session (stdout and stderr together)."""
        script = "".join(f"{c.text}\n__rc=$?; echo {SEPARATOR}; (exit $__rc)\n" for c in block.commands())
        proc = subprocess.Popen(["bash", "-c", script], cwd=self.root, env=self.block_env(block), stdout=subprocess.PIPE,
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
    return Block(block.doc, block.line, block.args, lines, block.start, block.tag)


def update(doc: Path) -> None:
    """Write the real outputs of the document's checked transcripts back into it."""
    lines = doc.read_text().splitlines()
    doc_blocks = blocks(doc)
    workspace = Workspace()
    replacements = []
    try:
        for block in [b for b in doc_blocks if b.rerun]:
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
    if args[:1] == ["--update"]:
        for name in args[1:]:
            update(Path(name).resolve())
    else:
        for name in args:
            space = Workspace()
            for b in blocks(Path(name).resolve()):
                if b.rerun:
                    space.write_files(blocks(b.doc), b)
                    print(f"== {b.name}", *check(b, space), sep="\n")
            space.close()
