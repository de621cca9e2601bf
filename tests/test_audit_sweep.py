"""The generic sweep and the rebuilding of contracted results: pure functions, no ranks."""

import enum
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import pytest
import torch

from shardcheck.megatron.audit.divergence import assemble_result, gap
from shardcheck.megatron.audit.sweep import (
    Case,
    layouts,
    parse_value,
    plan,
    setup_kwargs,
    values_to_try,
)
from shardcheck.megatron.checks.contracts import ProbeRecord
from shardcheck.parity.layout import Layout


class Color(enum.Enum):
    RED = 1
    BLUE = 2


@pytest.mark.parametrize(("annotation", "default", "expected"), [
    (bool, False, [True]),
    (bool | None, None, [True, False]),
    (Literal["a", "b", "c"], "b", ["a", "c"]),
    (Color, Color.RED, [Color.BLUE]),
    (float, 0.0, [0.1]),
    (float, 0.5, []),
    (int, 3, []),
    (Optional[bool], True, [False, None]),  # noqa: UP045 - Megatron writes Optional
    (Annotated[bool, "doc"], False, [True]),
    (Optional[Literal["x", "y"]], "x", ["y"]),  # noqa: UP045 - Megatron writes Optional
    (Literal[("a", "b"), ["c"]], ("a", "b"), [["c"]]),
    (Literal["a", Literal["b"]], "a", ["b"]),
    (Callable[[torch.Tensor], torch.Tensor], None, []),
    (Annotated[Color | None, "doc"], Color.RED, [Color.BLUE]),
    (typing.ForwardRef("NotImported"), None, []),
])
def test_values_to_try_are_every_other_value_of_the_type(annotation, default, expected):
    assert values_to_try(annotation, default) == expected


@dataclass(frozen=True)
class _Setup:
    hidden: int = 8
    padding: bool = False
    config: dict | None = None


def test_options_split_between_setup_fields_and_config():
    assert setup_kwargs(_Setup, [("padding", True), ("normalization", "RMSNorm")]) == {
        "padding": True, "config": {"normalization": "RMSNorm"}}


def test_layouts_cover_every_small_grid_with_sp_and_ep_variants():
    names = {str(lay) for lay in layouts(4)}
    assert {"tp2", "tp2-sp", "cp2", "dp2", "pp2", "dp2-ep2", "tp2-dp2-sp", "cp2-dp2", "tp2-pp2"} <= names
    assert all(lay.world_size <= 4 for lay in layouts(4))
    assert not any(lay.world_size > 2 for lay in layouts(2))


def test_plan_runs_defaults_under_every_layout_first_then_spreads_options_over_layouts():
    small = [Layout(tp=2), Layout(cp=2)]
    cases = plan({"a": [("x", True), ("y", True)], "b": [("z", 1)]}, small + [Layout(tp=2, dp=2)], None)
    assert [c.options for c in cases[:6]] == [()] * 6
    singles = cases[6:9]
    assert {c.options for c in singles} == {(("x", True),), (("y", True),), (("z", 1),)}
    assert {c.layout for c in singles} == set(small)  # the first pass already uses both layouts
    assert len(cases) == 6 + 3 * 3
    assert plan({"a": [("x", True)]}, small, 3) == [
        Case("a", (), small[0]), Case("a", (), small[1]), Case("a", (("x", True),), small[0])]


def test_set_values_parse_like_the_command_line():
    assert [parse_value(v) for v in ("true", "False", "none", "3", "0.1", "rope")] == [
        True, False, None, 3, 0.1, "rope"]


def _records(values, groups=None):
    return {rank: ProbeRecord("f", 0, [torch.tensor(v, dtype=torch.float64)], groups or {})
            for rank, v in enumerate(values)}


def test_partial_over_an_argument_group_is_summed():
    records = _records([3.0, 5.0], {"reduce_group": (0, 1)})
    assert assemble_result(Layout(tp=2), records, 0, {"group:reduce_group": "P"}).item() == 8.0


def test_replicated_keeps_the_replica_that_differs():
    assert assemble_result(Layout(tp=2), _records([4.0, 4.5]), 0, {"tp": "R"}).item() == 4.5
    assert assemble_result(Layout(tp=2), _records([4.0, 4.0]), 0, {"tp": "R"}).item() == 4.0


def test_sequence_sharded_over_cp_is_rebuilt_in_load_balanced_order():
    # cp=2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    records = _records([[0.0, 3.0], [1.0, 2.0]])
    rebuilt = assemble_result(Layout(cp=2), records, 0, {"cp": "S(0)"})
    assert rebuilt.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_average_partial_and_uncovered_axes():
    assert assemble_result(Layout(cp=2), _records([1.0, 3.0]), 0, {"cp": "P(avg)"}).item() == 2.0
    assert assemble_result(Layout(dp=2), _records([1.0, 3.0]), 0, {"tp": "R"}) is None


def test_gap_tolerates_reassociation_and_reports_a_real_error():
    reference = torch.linspace(-1, 1, 100, dtype=torch.float64)
    assert gap("grad/w", reference * (1 + 1e-7), reference) is None
    found = gap("grad/w", reference * (1 + 1e-3), reference)
    assert found is not None and found.relative == pytest.approx(1e-3, rel=1e-3)
    assert gap("loss", torch.zeros(2), torch.zeros(3)).max_error == float("inf")


def _outcome(layout, options=(), gaps=1, call=None, violations=(), entry="megatron/core/x.py:1"):
    from types import SimpleNamespace

    from shardcheck.megatron.audit.divergence import CallGap, Gap

    found = [Gap("loss", 1.0, 2.0, 1.0, 0.5, 1e-6)] * gaps
    call_gap = CallGap(call, 0, found[0]) if call else None
    return SimpleNamespace(case=Case("c", options, Layout.parse(layout)), gaps=found, call_gap=call_gap,
                           violations=list(violations), entry=entry)


def test_checker_line_of_a_finding_is_its_own_file_or_its_trigger_cases_not_another_members():
    from shardcheck.megatron.audit.report import checker_violation

    def violation(where):
        return {"rule": "mixed shards", "location": where, "line": f"checker: mixed shards at {where}"}

    trigger = _outcome("tp2")  # the finding's minimal case, without a violation of its own
    other_bug = _outcome("tp2", (("bias", True),), violations=[violation("megatron/core/layers.py:490")])
    assert checker_violation("megatron/core/gdn.py:249", [trigger, other_bug], set()) is None
    assert checker_violation("megatron/core/gdn.py:249", [other_bug, trigger], set()) == \
        violation("megatron/core/layers.py:490")  # the trigger's own violation
    same_file = _outcome("tp2-sp", violations=[violation("megatron/core/gdn.py:330")])
    assert checker_violation("megatron/core/gdn.py:249", [trigger, other_bug, same_file], set()) == \
        violation("megatron/core/gdn.py:330")  # any member's, in the finding's file


def test_findings_are_deduplicated_by_location_and_contract():
    from shardcheck.megatron.audit.report import case_size, group

    smoothing = (("label_smoothing", 0.1),)
    failed = [_outcome("tp2-dp2", smoothing, call="vocab_parallel_cross_entropy"),
              _outcome("tp2", smoothing, call="vocab_parallel_cross_entropy"),
              _outcome("cp2-dp2", smoothing, call=None)]  # unlocated: joins the same options
    groups = group(failed)
    [(key, members)] = groups.items()
    assert "cross_entropy.py" in key[0] and "ensures loss: tp=R" in key[1]
    assert str(min(members, key=lambda o: case_size(o.case)).case.layout) == "tp2"


def test_a_violation_seen_in_a_numeric_finding_explains_it_instead_of_adding_one():
    from shardcheck.megatron.audit.report import group

    violation = {"rule": "mean over shard", "location": "megatron/core/a.py:3", "line": "checker: ..."}
    failed = [_outcome("tp2", (("o", 1),), call="get_tokens_per_expert_and_token_count", violations=[violation]),
              _outcome("tp2-sp", (("o", 1),), gaps=0, violations=[violation]),
              _outcome("cp2", gaps=0, violations=[{**violation, "location": "megatron/core/b.py:9"}])]
    keys = sorted(group(failed))
    assert len(keys) == 2 and keys[0][0] == "megatron/core/b.py:9"


def test_rounding_noise_of_a_zero_gradient_is_judged_at_its_family_scale():
    from shardcheck.megatron.audit.divergence import output_gaps

    reference = {"grad/w": torch.tensor([0.3, -0.2]), "grad/b": torch.tensor([1.6e-9, -9.8e-10])}
    noisy = {"grad/w": torch.tensor([0.3, -0.2]), "grad/b": torch.tensor([-3.5e-10, 4.5e-10])}
    assert output_gaps([noisy], reference) == []
    wrong = {"grad/w": torch.tensor([0.3003, -0.2]), "grad/b": torch.tensor([1.6e-9, -9.8e-10])}
    assert [g.name for g in output_gaps([wrong], reference)] == ["grad/w"]


def test_calls_are_compared_only_when_every_rank_made_as_many_as_the_reference():
    from shardcheck.megatron.audit.divergence import first_call_gap

    def norm(index, value):
        return ProbeRecord("get_grad_norm_fp32", index, [torch.tensor(value, dtype=torch.float64)], {})

    reference = [norm(0, 2.0)]
    layout = Layout(tp=2)
    split = [[norm(0, 1.0), norm(1, 1.5)]] * 2  # dense and expert norms, computed apart
    assert first_call_gap(layout, split, reference) is None
    wrong = first_call_gap(layout, [[norm(0, 1.0)]] * 2, reference)
    assert wrong is not None and wrong.contract == "get_grad_norm_fp32"
    assert first_call_gap(layout, [[norm(0, 2.0)]] * 2, reference) is None
