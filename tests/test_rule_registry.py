"""The rule registry: one table, built from what each rule module declares, changed only there."""

import ast
import enum
from pathlib import Path

import torch

import shardcheck
from shardcheck.typecheck.rules import arithmetic, backward, indexing, registry, token_rows

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
