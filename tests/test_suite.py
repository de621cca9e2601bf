"""The suite runs one way: under `pytest` and `python -m pytest` alike, each module loaded once,
every test capped in time."""

import re
import sys
from collections import defaultdict
from pathlib import Path

import golden_data  # noqa: F401  (helpers, loaded here by their one top-level name)
import grad_programs  # noqa: F401
import planted.bugs  # noqa: F401

TESTS = Path(__file__).resolve().parent
PACKAGE_IMPORT = re.compile(r"^\s*(?:from\s+tests(?:\.|\s+import\b)|import\s+tests\b)", re.M)


def test_helpers_are_imported_by_their_top_level_name_only():
    """`from tests import x` works under `python -m pytest` only (the working folder on the path)
    and loads x a second time beside `import x`, with a second copy of its state."""
    assert [p.name for p in TESTS.rglob("*.py") if PACKAGE_IMPORT.search(p.read_text())] == []
    names = defaultdict(set)
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve().is_relative_to(TESTS):
            names[Path(path).resolve()].add(name)
    assert {TESTS / "grad_programs.py", TESTS / "planted" / "bugs.py"} <= set(names)
    assert {path.name: sorted(n) for path, n in names.items() if len(n) > 1} == {}


def test_every_test_is_capped_in_time(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert float(pytestconfig.getini("timeout")) > 0
