"""The package layout's promises: no import cycle, the core knows nothing of what sits on it,
megatron's inner layers import only the layers below them, and no shardcheck module is imported
by a string (``importlib.import_module("shardcheck...")``), where this test could not see it."""

import ast
import re
from pathlib import Path

import pytest

import shardcheck

PACKAGE = Path(shardcheck.__file__).parent
CORE = ("shardcheck.typecheck", "shardcheck.parity")
ON_TOP = ("shardcheck.megatron", "shardcheck.golden", "shardcheck.cli", "shardcheck.fuzz")
# megatron's inner layers, lowest first: the checks on Megatron's own code, the CPU harness that
# runs it, the scenarios built on the harness, the audit and the training check that run the
# scenarios, the repro scripts made from audit findings; shardcheck.megatron's own modules
# (fuzz_targets) sit above them all. A layer imports its own package and the layers below it.
MEGATRON_TIERS = (("checks",), ("cpu",), ("scenarios",), ("audit", "train"), ("repro",))
DYNAMIC_IMPORTS = ("import_module", "find_spec", "__import__")
OBJECT_REFERENCE = re.compile(r"^(shardcheck(?:\.\w+)+):\w+$")


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
    return _imports_in(MODULES[module].read_text(), module)


def _imports_in(source: str, module: str) -> set[str]:
    """Every shardcheck module that ``source`` (the text of ``module``) imports, at module level
    or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {target for n in names if n.startswith("shardcheck") and (target := _resolve(n))}
    return found - {module, "shardcheck"}


GRAPH = {module: _imports(module) for module in MODULES}


def _megatron_layer(module: str) -> tuple[int, str] | None:
    """(tier, package) of a module inside shardcheck.megatron: its layer's rank in
    :data:`MEGATRON_TIERS` (above them all for shardcheck.megatron's own modules); None outside."""
    if not (module + ".").startswith("shardcheck.megatron."):
        return None
    package = module.split(".")[2] if module.count(".") >= 2 else ""
    tier = next((i for i, layer in enumerate(MEGATRON_TIERS) if package in layer), len(MEGATRON_TIERS))
    return tier, package


def _upward(module: str, imports: set[str]) -> set[str]:
    """The megatron modules among ``imports`` that sit in ``module``'s tier or above it,
    outside its own package."""
    here = _megatron_layer(module)
    if here is None:
        return set()
    return {target for target in imports if (there := _megatron_layer(target)) is not None
            and there[1] != here[1] and there[0] >= here[0]}


def _above_the_core(module: str, imports: set[str]) -> set[str]:
    """What ``module``, if it is in the core, imports from the packages that sit on the core."""
    return {m for m in imports if m.startswith(ON_TOP)} if module.startswith(CORE) else set()


def _string_imports(source: str) -> set[str]:
    """The shardcheck modules ``source`` imports by a string (``importlib.import_module``,
    ``importlib.util.find_spec``, ``__import__``), given as a literal or a module-level constant."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        argument = node.args[0]
        name = argument.value if isinstance(argument, ast.Constant) else constants.get(getattr(argument, "id", ""))
        if called in DYNAMIC_IMPORTS and isinstance(name, str) and name.split(".")[0] == "shardcheck":
            found.add(name)
    # a "module:object" reference, kept as data and imported later by whatever reads it
    return found | {match[1] for node in ast.walk(tree) if isinstance(node, ast.Constant)
                    and isinstance(node.value, str) and (match := OBJECT_REFERENCE.match(node.value))}


def _cycle_from(start: str, graph: dict[str, set[str]] = GRAPH) -> list[str] | None:
    """The shortest import cycle through ``start``, or None (a breadth-first walk, each module once)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    return None


def test_the_graph_sees_imports():
    assert "shardcheck.typecheck.checker" in GRAPH["shardcheck.parity.pool"]
    assert "shardcheck.typecheck.checker" in GRAPH["shardcheck"]


def test_a_planted_cycle_is_found_through_each_of_its_modules():
    graph = {"a": {"b"}, "b": {"c", "e"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycle_from("b", graph) == ["b", "c", "a", "b"]
    assert _cycle_from("a", graph) == ["a", "b", "c", "a"]
    assert _cycle_from("e", graph) == ["e", "e"]
    assert _cycle_from("d", graph) is None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_cycle(module):
    assert _cycle_from(module) is None, " -> ".join(_cycle_from(module))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(CORE)))
def test_the_core_imports_nothing_above_it(module):
    above = _above_the_core(module, GRAPH[module])
    assert not above, f"{module} imports {sorted(above)}"


def test_the_megatron_tiers_cover_its_packages():
    packages = {m.split(".")[2] for m in MODULES if m.startswith("shardcheck.megatron.") and MODULES[m].name == "__init__.py"}
    assert packages == {package for layer in MEGATRON_TIERS for package in layer}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("shardcheck.megatron")))
def test_megatron_layers_import_only_the_layers_below_them(module):
    upward = _upward(module, GRAPH[module])
    assert not upward, f"{module} imports {sorted(upward)}, which sit in its tier or above it"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_shardcheck_module_is_imported_by_a_string(module):
    hidden = _string_imports(MODULES[module].read_text())
    assert not hidden, f"{module} imports {sorted(hidden)} by a string: import it plainly"


PLANTED_FUNCTION_IMPORT = '''
def typed():
    from shardcheck.megatron.scenarios import training  # a scenario module, two tiers up

    return training.data_parallel_share
'''
PLANTED_STRING_IMPORT = '''
import importlib
import importlib.util

CATALOGUE = "shardcheck.megatron.fuzz_targets"
TEMPLATE = {"gpt": "shardcheck.megatron.scenarios.gpt:GPTSetup"}  # resolved by whoever reads it


def share():
    return importlib.import_module("shardcheck.megatron.scenarios.training").data_parallel_share


def present():
    return importlib.util.find_spec(CATALOGUE) is not None and importlib.util.find_spec("megatron.core")
'''


def test_a_planted_function_level_upward_import_fails_the_checks():
    imports = _imports_in(PLANTED_FUNCTION_IMPORT, "shardcheck.megatron.checks.planted")
    assert imports == {"shardcheck.megatron.scenarios.training"}
    assert _upward("shardcheck.megatron.checks.planted", imports) == imports
    assert _upward("shardcheck.megatron.scenarios.planted", imports) == set()  # its own package
    assert _upward("shardcheck.megatron.audit.planted", imports) == set()  # a layer below
    assert _upward("shardcheck.megatron.fuzz_targets", imports) == set()
    core_imports = _imports_in(PLANTED_FUNCTION_IMPORT, "shardcheck.parity.planted")
    assert _above_the_core("shardcheck.parity.planted", core_imports) == imports


def test_a_planted_string_import_fails_the_check():
    assert _string_imports(PLANTED_STRING_IMPORT) == {"shardcheck.megatron.scenarios.training",
                                                      "shardcheck.megatron.fuzz_targets",
                                                      "shardcheck.megatron.scenarios.gpt"}
    assert _imports_in(PLANTED_STRING_IMPORT, "shardcheck.megatron.checks.planted") == set()  # unseen there


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
