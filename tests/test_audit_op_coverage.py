"""The audit's op coverage: the share of the op calls made in megatron-core's files that the
checker typed, per component and layout, in the report and findings.json."""

import json

import pytest
import torch

import shardcheck as sc
from shardcheck.megatron.audit import report as audit_report
from shardcheck.megatron.audit.outcome import Outcome, op_counts
from shardcheck.megatron.audit.summary import AuditResult, typed_share
from shardcheck.megatron.audit.sweep import Case
from shardcheck.parity.layout import Layout

MESH = sc.Mesh(rank=0, tp=[0, 1])


def _outcome(layout: str, typed: int, unknown_at: dict[str, int]) -> Outcome:
    ops = {"typed": typed, "unknown": sum(unknown_at.values()), "unknown_at": unknown_at}
    return Outcome(Case("gpt", (), Layout.parse(layout)), ops=ops)


def test_op_counts_add_up_over_ranks_and_none_when_unchecked():
    ranks = [{"typed": 9, "unknown": 1, "unknown_at": {"a.py:1": 1}},
             {"typed": 8, "unknown": 2, "unknown_at": {"a.py:1": 1, "b.py:2": 1}}]
    assert op_counts(ranks) == {"typed": 17, "unknown": 3, "unknown_at": {"a.py:1": 2, "b.py:2": 1},
                                "unknown_from": {}}
    assert op_counts([None, None]) is None
    shown = typed_share(op_counts(ranks))
    assert shown == {"typed": 17, "calls": 20, "typed_share": 0.85, "unknown_at": ["a.py:1 (2)", "b.py:2 (1)"],
                     "unknown_from": []}


def test_coverage_gives_the_typed_share_per_layout_and_the_report_shows_it(tmp_path):
    result = AuditResult([], [_outcome("tp2", 99, {"x.py:3": 1}), _outcome("tp2", 100, {}),
                              _outcome("cp2", 30, {"y.py:4": 10})], [], 1.0, False)
    ops = result.coverage()["gpt"]["megatron_ops"]
    assert (ops["typed"], ops["calls"]) == (229, 240)
    assert ops["by_layout"]["tp2"]["typed_share"] == 0.995
    assert ops["by_layout"]["cp2"] == {"typed": 30, "calls": 40, "typed_share": 0.75,
                                       "unknown_at": ["y.py:4 (10)"], "unknown_from": []}
    audit_report.write(tmp_path, [], result.summary())
    assert json.loads((tmp_path / "findings.json").read_text())["coverage"]["gpt"]["megatron_ops"] == ops
    text = (tmp_path / "report.md").read_text()
    assert "| 95.4% of 240 |" in text
    assert "| gpt | cp2 | 75.0% | 40 | `y.py:4 (10)` |" in text


def test_a_layout_typed_below_99_percent_names_the_origins_of_its_unknowns(tmp_path):
    """Per rank, each unknown op call counts at its origin; summed over ranks, the few origins
    that explain 90% of a layout's unknown calls are named with their causes, in findings.json
    and in the report (a layout typed well enough is not listed)."""
    gap = {"y.py:4 convolution: aten.convolution's rule gives no type to {cp:S(2)}, {cp:R}": 7,
           "z.py:9 mul: input 1 (a tensor float32[4]) entered the checked region untyped": 2,
           "w.py:1 cumsum: no rule for aten.cumsum": 1}
    ranks = [_outcome("cp2", 15, {"y.py:4": 5}), _outcome("cp2", 15, {"y.py:4": 5}),
             _outcome("tp2", 999, {"x.py:3": 1})]
    ranks[0].ops["unknown_from"] = {k: (n + 1) // 2 for k, n in gap.items()}
    ranks[1].ops["unknown_from"] = {k: n // 2 for k, n in gap.items()}
    ranks[2].ops["unknown_from"] = {"x.py:3 inv: no rule for aten.linalg_inv_ex": 1}
    ops = AuditResult([], ranks, [], 1.0, False).coverage()["gpt"]["megatron_ops"]
    assert ops["by_layout"]["cp2"]["unknown_from"] == [
        {"origin": "y.py:4 convolution", "cause": "aten.convolution's rule gives no type to {cp:S(2)}, {cp:R}",
         "calls": 7, "share": 0.7},
        {"origin": "z.py:9 mul", "cause": "input 1 (a tensor float32[4]) entered the checked region untyped",
         "calls": 2, "share": 0.2}]  # 90% explained: the cumsum is left out
    text = "\n".join(audit_report.coverage_table({"gpt": {**_row(), "megatron_ops": ops}}))
    assert ("| gpt | cp2 | 75.0% | `y.py:4 convolution` | aten.convolution's rule gives no type to "
            "{cp:S(2)}, {cp:R} | 70.0% |") in text
    assert "| gpt | tp2 | 99.9% | `x.py:3" not in text


def _row() -> dict:
    return {"plain_layouts": ["cp2", "tp2"], "explicit_layouts": [], "option_sets_run": 1,
            "option_sets_left_out": 0, "cases": 3}


def test_an_unchecked_audit_has_no_op_coverage():
    result = AuditResult([], [Outcome(Case("gpt", (), Layout(tp=2)))], [], 1.0, False)
    assert "megatron_ops" not in result.coverage()["gpt"]
    assert "megatron-core ops typed" in "\n".join(audit_report.coverage_table(result.coverage()))


def test_megatron_ops_counts_only_calls_made_in_megatron_core():
    """A megatron-core helper on a typed and on an untyped tensor: its calls are counted at
    its own file:line; our own ops are left out."""
    pytest.importorskip("megatron.core")
    from megatron.core.tensor_parallel.utils import split_tensor_along_last_dim

    from shardcheck.megatron.checks.typecheck import megatron_ops

    with sc.typecheck(MESH, sites=True):
        typed = sc.annotate(torch.randn(4, 6), tp=sc.R)
        split_tensor_along_last_dim(typed, 2)
        split_tensor_along_last_dim(torch.linalg.inv(torch.randn(6, 6)), 2)
        torch.linalg.inv(torch.randn(3, 3)) * 2  # unknown, but in this file
    ops = megatron_ops(sc.coverage())
    assert ops["typed"] >= 1 and ops["unknown"] >= 1
    assert all(loc.startswith("megatron/core/tensor_parallel/utils.py:") for loc in ops["unknown_at"])
    assert sum(ops["unknown_at"].values()) == ops["unknown"]
    # the unknown began in this file (no rule for the inverse), and reached megatron-core's calls
    [(origin, calls)] = ops["unknown_from"].items()
    assert origin.endswith("linalg_inv_ex: no rule for aten.linalg_inv_ex") and calls == ops["unknown"]


@pytest.mark.slow
@pytest.mark.parametrize("component, layout, least", [
    ("gpt", "cp2", 0.99), ("gpt", "tp2-sp", 0.99), ("moe", "tp2-sp", 0.99), ("moe", "cp2", 0.99),
    ("output_loss", "cp2", 0.99), ("output_loss", "tp2-sp", 0.99)])
def test_a_step_types_nearly_all_of_megatron_cores_op_calls(component, layout, least, audit_pools):
    """The default case on real ranks: parameters typed when DDP lays out its buffers,
    autograd's as_strided views and Megatron's reused memory
    buffer typed, the RNG state V, the ops Gloo makes when an async reduce-scatter is waited
    on excused."""
    from shardcheck.megatron.audit.runner import Runner

    outcome = Runner(audit_pools, typecheck=True).run(Case(component, (), Layout.parse(layout)))
    assert not outcome.error and not outcome.gaps and not outcome.violations
    shown = typed_share(outcome.ops)
    assert shown["typed_share"] >= least, shown
