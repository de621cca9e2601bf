"""The package layout's promises: no import cycle, and the core knows nothing of what sits on it."""

import ast
from pathlib import Path

import pytest

import shardcheck

PACKAGE = Path(shardcheck.__file__).parent
CORE = ("shardcheck.typecheck", "shardcheck.parity")
ON_TOP = ("shardcheck.megatron", "shardcheck.golden", "shardcheck.cli", "shardcheck.fuzz")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The shardcheck module an imported name lives in (a module, or an attribute of one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """Every shardcheck module ``module`` imports, at module level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {target for n in names if n.startswith("shardcheck") and (target := _resolve(n))}
    return found - {module, "shardcheck"}


GRAPH = {module: _imports(module) for module in MODULES}


def _cycle_from(start: str) -> list[str] | None:
    stack, path, on_path = [(start, iter(sorted(GRAPH[start])))], [start], {start}
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.discard(path.pop())
        elif child == start:
            return [*path, start]
        elif child not in on_path and child > start:
            stack.append((child, iter(sorted(GRAPH[child]))))
            path.append(child)
            on_path.add(child)
    return None


def test_the_graph_sees_imports():
    assert "shardcheck.typecheck.checker" in GRAPH["shardcheck.parity.pool"]
    assert "shardcheck.typecheck.checker" in GRAPH["shardcheck"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_cycle(module):
    assert _cycle_from(module) is None, " -> ".join(_cycle_from(module))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(CORE)))
def test_the_core_imports_nothing_above_it(module):
    above = {m for m in GRAPH[module] if m.startswith(ON_TOP)}
    assert not above, f"{module} imports {sorted(above)}"


def test_the_public_api_is_unchanged():
    assert set(shardcheck.__all__) == {
        "I", "P", "R", "S", "V", "Axis", "Mesh", "Placement", "Shard", "__version__",
        "Layout", "LayoutError", "ScenarioContext", "current_context", "replicate", "shard",
        "Coverage", "SpmdTypeError", "annotate", "assert_type", "confirmed_across_ranks",
        "contract", "coverage", "rank_slice", "register_rule", "typecheck", "typeof",
        "violations", "ParityResult", "PoolFailure", "RankPool", "parity",
        "annotate_parameters", "check_gradients",
    }
    assert all(hasattr(shardcheck, name) for name in shardcheck.__all__)
    assert callable(shardcheck.typecheck) and callable(shardcheck.parity)
