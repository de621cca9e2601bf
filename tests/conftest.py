"""Suite-wide setup.

One intra-op thread: ``spawn_ranks`` forks, and a child forked after the parent ran an
OpenMP-parallel kernel (e.g. a layer_norm backward) hangs in its first parallel kernel.
With one thread the parent never starts the OpenMP pool. (Also kinder to 2 shared cores.)
"""

import ast
import re
from functools import cache
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

_MEGATRON_MODULE = re.compile(r"^(?:megatron|shardcheck\.megatron)(?:\.|$)")
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _imports_megatron(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(_MEGATRON_MODULE.match(alias.name) for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return bool(node.module and _MEGATRON_MODULE.match(node.module))
    return (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
            and any(isinstance(a, ast.Constant) and str(a.value).startswith("megatron") for a in node.args))


def _names(node: ast.AST) -> set[str]:
    found = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if isinstance(node, _FUNCTIONS):  # fixtures are named by the test's arguments
        found |= {a.arg for a in node.args.args}
    return found


def _outside_functions(node: ast.AST):
    """The nodes of a module that run at import time (bodies of functions excluded)."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, _FUNCTIONS):
            yield child
            yield from _outside_functions(child)


@cache
def _megatron_use(path: str) -> tuple[bool, frozenset[str]]:
    """Whether a test module imports megatron-core or the adapter at import time, and else the
    names of its functions that do, directly or through another of its functions they name."""
    tree = ast.parse(Path(path).read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, _FUNCTIONS)]
    using = {f.name for f in functions if any(_imports_megatron(n) for n in ast.walk(f))}
    calls = {f.name: _names(f) for f in functions}
    while True:
        grown = using | {name for name, named in calls.items() if named & using}
        if grown == using:
            break
        using = grown
    at_import = list(_outside_functions(tree))
    whole = any(_imports_megatron(n) for n in at_import) or any(
        isinstance(n, ast.Name) and n.id in using for n in at_import)
    return whole, frozenset(using)


def pytest_collection_modifyitems(items):
    """Mark ``megatron`` every test that imports megatron-core or the adapter (its module at
    import time, or the test itself through the functions and fixtures it names), so that
    ``-m megatron`` reruns exactly those on another megatron-core release."""
    for item in items:
        whole, functions = _megatron_use(str(item.path))
        if whole or getattr(item, "originalname", item.name) in functions:
            item.add_marker(pytest.mark.megatron)


_AUDIT_POOLS: list = []


@pytest.fixture(scope="session")
def audit_pools():
    """The audit's warm rank pools, shared by every test that audits, and with them the one-rank
    references computed on them; closed after the last test that uses them."""
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.runner import PRELOAD, Pools

    for module in PRELOAD:  # imported before the ranks fork, as the audit itself does
        __import__(module)
    shared = Pools()
    _AUDIT_POOLS.append(shared)
    yield shared
    shared.close()


def pytest_runtest_teardown(item, nextitem):
    """Close the shared audit pools once no later test needs them: idle ranks' Gloo threads
    cost CPU for the rest of the run."""
    if _AUDIT_POOLS and "audit_pools" in item.fixturenames and not any(
            "audit_pools" in later.fixturenames for later in _later_items(item)):
        _AUDIT_POOLS.pop().close()


def _later_items(item):
    items = item.session.items
    return items[items.index(item) + 1:]
