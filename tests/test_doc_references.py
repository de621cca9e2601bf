"""References from README.md and docs/*.md into this repository's files point where they say.

A reference is ``path:line`` (or ``path:first-last``), optionally followed by `` in NAME`` as the
checker prints it (``tests/grad_programs.py:379 in check_gradients``), or ``path::name``
(``tests/grad_programs.py::per_head_scale``, ``tests/test_x.py::Class::test_y``). The path counts
as this repository's when its first component is a top-level entry of the checkout; paths into
megatron-core (``megatron/...``) belong to that library and are left out, and so are the
transcripts the docs check reruns (``tests/test_docs.py`` compares those with real output).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from docs_check import DOCUMENTS, REPO, blocks

REFERENCE = re.compile(
    r"(?<![\w./<>-])(?P<path>[\w-][\w.-]*(?:/[\w.-]+)*\.[A-Za-z]+)"
    r"(?:::(?P<names>[A-Za-z_]\w*(?:(?:::|\.)[A-Za-z_]\w*)*)"
    r"|:(?P<line>\d+)(?:-(?P<last>\d+))?(?:`? in `?(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*))?)")
NEAR = 3  # a name given with a line must appear within this many lines of it
DISPATCH_OPS = ("aten.", "prims.", "c10d.", "_c10d_functional.")  # what the checker names, not code


def _rerun_lines(doc: Path) -> set[int]:
    """0-based lines of the transcripts the docs check reruns."""
    return {block.start + i for block in blocks(doc) if block.rerun for i in range(len(block.lines))}


def _defined(tree: ast.AST, names: list[str]) -> bool:
    """``names`` is a chain of nested definitions (``Class``, ``method``) or a module-level
    assignment in ``tree``."""
    body = tree.body
    for index, name in enumerate(names):
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = node
            elif index == 0 and isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def problems(doc: Path, root: Path = REPO) -> list[str]:
    """Each reference of ``doc`` into ``root`` that does not hold, as 'doc:line: why'."""
    tops = {entry.name for entry in root.iterdir() if not entry.name.startswith(".")}
    skipped = _rerun_lines(doc)
    found = []
    for number, text in enumerate(doc.read_text().splitlines()):
        if number in skipped:
            continue
        for ref in REFERENCE.finditer(text):
            path = ref["path"]
            if path.startswith("megatron/") or path.split("/")[0] not in tops:
                continue
            where, target = f"{doc.name}:{number + 1}: {ref[0]}", root / path
            if not target.is_file():
                found.append(f"{where}: no file {path}")
                continue
            lines = target.read_text().splitlines()
            if ref["names"]:
                chain = re.split(r"::|\.", ref["names"])
                if target.suffix == ".py":
                    if not _defined(ast.parse(target.read_text()), chain):
                        found.append(f"{where}: {path} defines no {ref['names']}")
                elif chain[-1] not in target.read_text():
                    found.append(f"{where}: {chain[-1]} is not in {path}")
                continue
            first, last = int(ref["line"]), int(ref["last"] or ref["line"])
            if not 1 <= first <= last <= len(lines):
                found.append(f"{where}: {path} has {len(lines)} lines")
                continue
            name = ref["name"]
            if name and not name.startswith(DISPATCH_OPS):
                nearby = "\n".join(lines[max(0, first - 1 - NEAR):last + NEAR])
                if not re.search(rf"(?<!\w){re.escape(name)}(?!\w)", nearby):
                    found.append(f"{where}: no {name} within {NEAR} lines of line {first}")
    return found


def test_every_reference_in_the_docs_holds():
    found = [problem for doc in DOCUMENTS for problem in problems(doc)]
    assert found == [], "stale references into the repository:\n" + "\n".join(found)


def test_a_stale_reference_fails(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "prog.py").write_text(
        "import torch\n\nLIMIT = 3\n\n\nclass Model:\n    def step(self):\n        return 1\n\n\n"
        "def train(model):\n    model.step()\n    check_gradients(model)\n    train_step = 2\n")
    doc = tmp_path / "page.md"
    doc.write_text(
        "Good: `tests/prog.py:13 in check_gradients`, `tests/prog.py:11-14`, `tests/prog.py::train`,\n"
        "`tests/prog.py::Model::step`, `tests/prog.py::Model.step`, `tests/prog.py::LIMIT`,\n"
        "tests/prog.py:12 in model.step, `tests/prog.py:1 in aten.mul.Tensor`,\n"
        "`megatron/core/x.py:999`, `elsewhere/y.py:5`.\n"
        "Stale: `tests/prog.py:15`, `tests/prog.py:3 in check_gradients`, `tests/prog.py::gone`,\n"
        "`tests/prog.py::Model::train`, `tests/old.py:1`, `tests/prog.py:12-20`,\n"
        "tests/prog.py:14 in optimizer.step.\n"
        "\n<!-- docs-check -->\n```\n$ python tests/prog.py\nat tests/prog.py:99 in train\n```\n")
    found = problems(doc, tmp_path)
    assert [problem.split(": ", 2)[1] for problem in found] == [
        "tests/prog.py:15", "tests/prog.py:3 in check_gradients", "tests/prog.py::gone",
        "tests/prog.py::Model::train", "tests/old.py:1", "tests/prog.py:12-20",
        "tests/prog.py:14 in optimizer.step"], found
