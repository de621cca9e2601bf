"""The rule registry: one table, built from what each rule module declares, changed only there."""

import ast
import enum
from pathlib import Path

import torch

import shardcheck
from shardcheck.typecheck.checker import Checker
from shardcheck.typecheck.rules import arithmetic, backward, indexing, registry, token_rows
from shardcheck.typecheck.rules.common import RuleContext

PACKAGE = Path(shardcheck.__file__).parent
aten = torch.ops.aten


def _names(tree: ast.AST) -> set[str]:
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)})


def test_only_the_registry_changes_the_rule_table():
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "typecheck" / "rules" / "registry.py":
            continue
        names = _names(ast.parse(path.read_text()))
        assert "_TABLE" not in names, path
        assert not names & {"register_rule", "unregister_rule"} or path == PACKAGE / "__init__.py", path


def test_no_module_is_imported_for_its_side_effects():
    assert "noqa: F401" not in (PACKAGE / "__init__.py").read_text()
    assert shardcheck.register_rule is registry.register_rule


def test_a_refinement_chains_onto_the_rule_it_refines():
    rows_back = registry.rule_for(aten.index_add.default)  # token rows over backward over scatter_add
    assert rows_back.func is token_rows._add_rows_back
    add_into = rows_back.args[0]
    assert add_into.func is backward._add_into
    assert add_into.args[0] is indexing.RULES["scatter_add"]


def test_pointwise_ops_go_through_their_linearity():
    neg = registry.rule_for(aten.neg.default)
    assert neg.func is arithmetic.pointwise
    assert neg.args[0].linearity is arithmetic.Linearity.LINEAR
    assert registry.rule_for(aten.exp.default).args[0].linearity is arithmetic.Linearity.NONLINEAR
    mul = arithmetic.RULES["mul"]
    assert mul.args[0] == arithmetic.OpSpec(arithmetic.Linearity.MULTILINEAR,
                                            (arithmetic.MUL, arithmetic.MUL))
    assert registry.rule_for(aten.mul.Tensor).args[0] is mul  # refined by norm tracking


def test_value_kinds_are_enums():
    assert issubclass(registry.Known, enum.Flag) and issubclass(registry.ValueRule, enum.Enum)
    assert registry.value_rule("zeros_like") is registry.ValueRule.ZERO
    assert registry.value_rule("add") is registry.ValueRule.ADD
    assert registry.value_rule("matmul") is None


def test_known_tests_of_the_per_op_path_agree_with_its_operators():
    for value in range(16):
        flags = registry.Known(value)
        assert (flags in registry.WITH_ACC) == bool(flags & registry.Known.ACC)
        assert (flags in registry.WITH_ONE_RANK) == bool(flags & registry.Known.ONE_RANK)
        assert (flags in registry.CONST_OR_ZERO) == (flags in (registry.Known.CONST, registry.Known.ZERO))


def _context_reads(source: str) -> set[str]:
    """What the functions of ``source`` read of a parameter typed ``RuleContext``: the names after
    ``ctx.``; every rule's context parameter is ``ctx: RuleContext`` (checked as well)."""
    reads = set()
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef):
            continue
        for parameter in function.args.args:
            typed = parameter.annotation is not None and "RuleContext" in ast.unparse(parameter.annotation)
            assert typed == (parameter.arg == "ctx"), f"{function.name}: {parameter.arg}"
        reads |= {node.attr for node in ast.walk(function) if isinstance(node, ast.Attribute)
                  and isinstance(node.value, ast.Name) and node.value.id == "ctx"}
    return reads


def test_rules_read_only_what_their_context_declares():
    declared = {name for name in vars(RuleContext) if not name.startswith("_")} | set(RuleContext.__annotations__)
    for path in (PACKAGE / "typecheck" / "rules").glob("*.py"):
        source = path.read_text()
        assert _context_reads(source) <= declared, path
        assert "typecheck.checker" not in source, path  # rules never see the Checker's class
    assert all(hasattr(Checker, name) or name in Checker.__init__.__code__.co_names for name in declared)
    planted = "def _rule(ctx: RuleContext, args, kwargs, out):\n    ctx._report(None)\n"
    assert _context_reads(planted) - declared == {"_report"}
