"""The default plan's selection (``shardcheck audit`` without ``--full``): every component's
defaults under every layout, the Transformer Engine tier, each option set under the cheapest
layout of each parallel dimension, the scenario's own option classes under one explicit-group
layout (and an option set once where it is first read, when none of those reads it); the rest
is counted
as left to --full, which runs a superset. The sweep runs here on a stand-in for the rank pools
(every case runs clean), so the selection is checked without a rank."""

import time

import pytest

from shardcheck.megatron.audit.outcome import Outcome
from shardcheck.megatron.audit.runner import INERT
from shardcheck.megatron.audit.schedule import (
    Swept,
    explicit_layout,
    in_default_plan,
    option_layouts,
    sweep,
)
from shardcheck.megatron.audit.sweep import IMPL, Case, layouts, plan, runs_under
from shardcheck.parity.layout import Layout

LAYOUTS = layouts(explicit=True)
DEEP = (("deep", True),)  # an option no two-rank or explicit-group layout reads
ETP_ONLY = (("etp_only", True),)  # a moe option only the expert-tp layouts read


class _Pools:
    """Stands in for the rank pools: every case runs clean; ``deep`` is not read (pruned) under
    the two-rank and the explicit-group layouts, every other option everywhere."""

    def run(self, case: Case) -> Outcome:
        return Outcome(case)

    def screen(self, component: str, options: tuple) -> None:
        return None

    def not_read(self, case: Case) -> frozenset[str] | None:
        hidden = case.layout.world_size <= 2 or case.layout.explicit_groups
        if case.options == ETP_ONLY and case.layout.etp is None:
            return frozenset({"etp_only"})
        return frozenset({"deep"}) if case.options == DEEP and hidden else None

    def other_meaning(self, case: Case) -> None:
        return None


def _refused(case: Case) -> bool:
    from shardcheck.megatron.scenarios import COMPONENTS

    return COMPONENTS[case.component].refuses(case.layout) is not None


def _swept(cases: list[Case], full: bool) -> Swept:
    return sweep(_Pools(), cases, None, None, None, time.monotonic(), full=full)


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    pytest.importorskip("megatron.core")
    return plan({"gpt": [("a", True), ("b", "x"), DEEP[0]], "moe": [ETP_ONLY[0]], "t5": []}, LAYOUTS, None)


def test_the_default_plan_runs_defaults_everywhere_and_options_under_two_ranks(cases):
    swept = _swept(cases, full=False)
    ran = [o.case for o in swept.outcomes]
    applicable = [c for c in cases if not _refused(c)]
    assert {c for c in applicable if not c.options} <= set(ran)  # every component x layout
    assert {c for c in applicable if c.options == ((IMPL, "te"),)} <= set(ran)  # the TE tier
    assert option_layouts("gpt") == ("tp2", "cp2", "dp2", "pp2")  # one per parallel dimension
    assert {c for c in applicable if c.options in ((("a", True),), (("b", "x"),))
            and str(c.layout) in option_layouts("gpt")} == {c for c in ran if c.options and c.options[0][0] in "ab"}
    # an option that none of those reads runs once, at its first larger layout in plan order
    first = next(c for c in applicable if c.options == DEEP and c.layout.world_size > 2
                 and not c.layout.explicit_groups)
    assert [c for c in ran if c.options == DEEP] == [first]
    assert {"tp2", "cp2", "dp2", "pp2"} <= set(swept.pruned[("gpt", DEEP)])
    # an option only the expert-tp layouts read is not run there: their options are --full's
    assert not [c for c in ran if c.options == ETP_ONLY]
    assert set(swept.left_to_full) == {("gpt", (("a", True),)), ("gpt", (("b", "x"),)), ("gpt", DEEP),
                                       ("moe", ETP_ONLY)}
    assert not swept.not_swept and not swept.stopped_early


def test_full_runs_what_the_default_plan_ran_and_what_it_left_to_full(cases):
    default, full = _swept(cases, full=False), _swept(cases, full=True)
    ran, everything = [o.case for o in default.outcomes], [o.case for o in full.outcomes]
    assert set(ran) < set(everything) and not full.left_to_full
    assert len(everything) == len(ran) + sum(default.left_to_full.values())
    left = [c for c in everything if c not in set(ran)]
    assert all(c.options and not in_default_plan(c) for c in left)
    assert {(c.component, c.options) for c in left} == set(default.left_to_full)


def test_the_selection_is_deterministic(cases):
    first, second = _swept(cases, full=False), _swept(list(cases), full=False)
    assert [o.case for o in first.outcomes] == [o.case for o in second.outcomes]
    assert first.left_to_full == second.left_to_full


def test_the_time_limit_leaves_option_sets_not_reached_apart_from_those_left_to_full(cases):
    swept = sweep(_Pools(), cases, 40, None, None, time.monotonic(), full=False)
    assert swept.stopped_early and len(swept.outcomes) == 40
    reached = {(o.case.component, o.case.options) for o in swept.outcomes}
    assert all(why.startswith("not reached within the budget") for why in swept.not_swept.values())
    assert not set(swept.not_swept) & reached and not set(swept.left_to_full) - reached


def test_the_real_plan_selects_every_component_layout_and_option_class():
    """Over gpt's real options (setup fields, config fields, GPTModel arguments, bundles) and
    two more components: the selection keeps each component's defaults under every layout it
    runs under, every option set under the first layout of each parallel dimension it runs
    under, and the scenario's own option classes (setup fields, model arguments, bundles) under
    its explicit-group layout (tp and dp groups in another order; with sp for the MoE router)."""
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.sweep import sweep_plan

    whole, _ = sweep_plan(["gpt", "output_loss", "moe_router"], LAYOUTS)
    selected = [c for c in whole if in_default_plan(c)]
    for component in ("gpt", "output_loss", "moe_router"):
        assert {c.layout for c in selected if c.component == component and not c.options} == {
            lay for lay in LAYOUTS if runs_under(component, lay)}
    # the TE tier (defaults on TE, te_option_sets such as the GPT's packed sequences) is planned
    # at its own layouts (tests/test_audit_te.py)
    sets = {(c.component, c.options) for c in whole if dict(c.options).get(IMPL) != "te"}
    assert {(c.component, c.options, str(c.layout)) for c in selected if c.options} >= {
        (component, options, lay) for component, options in sets if options for lay in option_layouts(component)}
    assert option_layouts("moe_router") == ("tp2-sp", "cp2", "dp2", "dp2-ep2", "pp2")
    assert explicit_layout("gpt") == "tp2-dp2@dp-tp" and explicit_layout("moe_router") == "tp2-dp2-sp@dp-tp"
    explicit = {(c.component, c.options) for c in selected if str(c.layout) == explicit_layout(c.component)}
    assert {("gpt", (("loss_mask", True),)), ("gpt", (("GPTModel.forward.runtime_gather_output", True),))} <= explicit
    assert any(len(options) > 1 for _, options in explicit)  # bundles
    assert ("gpt", (("add_bias_linear", False),)) in sets - explicit  # a config field: left to --full
    names = {name for _, options in sets for name, _ in options}
    assert {"loss_mask", "recompute_granularity", "GPTModel.forward.runtime_gather_output"} <= names
    assert all(c.options and str(c.layout) not in option_layouts(c.component) for c in whole if not in_default_plan(c))
    assert Case("gpt", (), Layout(tp=2, cp=2, sp=True).regrouped("cp-tp")) in selected


class _InertA(_Pools):
    """``a`` changes no one-rank output: its cases wait for the plan to move to larger layouts."""

    def screen(self, component: str, options: tuple) -> str | None:
        return INERT if options == (("a", True),) else None


@pytest.mark.parametrize("share", [0.5, 0.8, 0.95])
def test_each_default_case_the_limit_cuts_is_listed_an_inert_options_deferred_ones_too(cases, share):
    whole = sweep(_InertA(), cases, None, None, None, time.monotonic(), full=False)
    budget = int(share * len(whole.outcomes))
    cut = sweep(_InertA(), cases, budget, None, None, time.monotonic(), full=False)
    ran = {o.case for o in cut.outcomes}
    assert cut.stopped_early and len(ran) == budget
    missing = {o.case for o in whole.outcomes} - ran
    assert missing  # the cut leaves default cases unrun, and each is named, once
    for case in missing:
        key = (case.component, case.options)
        assert (str(case.layout) in cut.unreached.get(key, ())) != (key in cut.not_swept)
    assert all(lay in {str(c.layout) for c in missing if (c.component, c.options) == key}
               for key, lays in cut.unreached.items() for lay in lays)
    assert not whole.unreached and not whole.stopped_early


def test_the_summary_counts_what_was_left_to_full_apart_from_what_was_not_reached():
    from shardcheck.megatron.audit.summary import AuditResult

    left = {("gpt", (("a", True),)): 12, ("gpt", DEEP): 3}
    not_swept = {("gpt", (("b", "x"),)): "not reached within the budget or time limit (6 case(s) left)",
                 ("gpt", (("c", True),)): "fails on one rank: boom"}
    result = AuditResult([], [], [], 1.0, False, left_out=not_swept, left_to_full=left)
    summary = result.summary()
    assert summary["option sets not reached (budget or time limit)"] == result.not_reached == 1
    assert summary["cases left to --full (the default plan's selection leaves them out)"] == 15
    assert summary["option sets with cases left to --full"] == 2
