"""One finding per root cause: independent triggers at one call site are findings of their own,
one bug reached by several option paths is one finding; "seen in" says what changes the result."""

import json
import os
from pathlib import Path

import pytest

from shardcheck.megatron.audit import report as audit_report
from shardcheck.megatron.audit.divergence import Gap
from shardcheck.megatron.audit.outcome import Outcome
from shardcheck.megatron.audit.report import causes, independent_cases, seen_in
from shardcheck.megatron.audit.sweep import Case
from shardcheck.megatron.checks.contracts import BY_NAME
from shardcheck.parity.layout import Layout

GAP = Gap("loss", 1.0, 2.0, 1.0, 0.5, 1e-6)


def _failing(options: tuple, layout: str, digest: str = "d0", numeric: bool = True) -> Outcome:
    return Outcome(Case("output_loss", options, Layout.parse(layout)), gaps=[GAP] if numeric else [],
                   violations=[] if numeric else [{"rule": "r", "location": "x:1", "line": "checker: r"}],
                   reference_digest=digest)


def _triggers(found: list[list[Outcome]]) -> list[set]:
    return [{(o.case.options, str(o.case.layout)) for o in cause} for cause in found]


A, B = ("a", True), ("b", True)


def test_independent_options_at_one_place_are_two_causes_and_a_superset_joins_its_subset():
    found = causes([_failing((A,), "tp2"), _failing((B,), "tp2"), _failing((A, B), "tp2"),
                    _failing((A,), "cp2")])
    assert _triggers(found) == [{((A,), "tp2"), ((A, B), "tp2"), ((A,), "cp2")}, {((B,), "tp2")}]


def test_a_superset_joins_only_where_its_subset_fails_under_the_same_layout():
    # (a, b) under cp2 diverges here, but (a,) does not under cp2: b's own cause there
    found = causes([_failing((A,), "tp2"), _failing((A, B), "cp2")])
    assert _triggers(found) == [{((A,), "tp2")}, {((A, B), "cp2")}]


def test_the_defaults_diverging_under_a_layout_cover_every_option_there_and_only_there():
    found = causes([_failing((), "cp2"), _failing((A,), "cp2"), _failing((B,), "tp2")])
    assert _triggers(found) == [{((), "cp2"), ((A,), "cp2")}, {((B,), "tp2")}]


def test_a_typed_case_never_becomes_the_trigger_of_a_numeric_cause():
    found = causes([_failing((), "tp2", numeric=False), _failing((A,), "tp2")])
    assert [[bool(o.gaps) for o in cause] for cause in found] == [[True], [False]]


def test_seen_in_lists_layouts_and_changing_options_and_counts_the_rest():
    trigger = _failing((A,), "tp2", digest="t")
    members = [trigger, _failing((A,), "tp2-sp", digest="t"), _failing((A, B), "tp2", digest="other"),
               *[_failing((A, (f"inert{i}", True)), "tp2", digest="t") for i in range(3)]]
    assert seen_in(members, trigger) == [
        "layouts: tp2, tp2-sp", "options that change the result: a=True, b=True",
        "and 3 option sets that do not change this component (its one-rank outputs equal the trigger's)"]


# ---- on real megatron-core ----------------------------------------------------------------

SMOOTHING, OTHER_SMOOTHING = (("label_smoothing", 0.1),), (("label_smoothing", 0.2),)
GATHERED, RUNTIME_GATHERED = (("parallel_output", False),), (("runtime_gather_output", True),)


@pytest.fixture(scope="module")
def pair():
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.run import audit

    tp2, tp2sp = Layout(tp=2), Layout(tp=2, sp=True)
    return audit([Case("output_loss", SMOOTHING, tp2), Case("output_loss", SMOOTHING, tp2sp),
                  Case("output_loss", (*SMOOTHING, ("runtime_gather_output", False)), tp2),
                  Case("output_loss", OTHER_SMOOTHING, tp2), Case("output_loss", GATHERED, tp2),
                  Case("output_loss", RUNTIME_GATHERED, tp2sp), Case("output_loss", (), tp2)])


@pytest.mark.slow
def test_two_independent_bugs_at_one_call_site_are_two_findings(pair):
    by_trigger = {tuple(f.trigger["options"].items()): f for f in pair.findings}
    assert set(by_trigger) == {SMOOTHING, GATHERED}, [f.trigger for f in pair.findings]
    smoothing, gathered = by_trigger[SMOOTHING], by_trigger[GATHERED]
    assert smoothing.location == gathered.location and smoothing.contract == gathered.contract
    assert smoothing.id != gathered.id
    # each its own trigger, corrected control and reproduce command
    assert smoothing.control["equal_to_reference"] and not gathered.control["equal_to_reference"]
    assert gathered.reproduce.endswith("--set parallel_output=False")
    assert [c["options"] for c in gathered.cases] == [{"parallel_output": False}]


@pytest.mark.slow
def test_gathered_logits_by_either_option_are_one_finding_with_no_verified_fix(pair):
    """parallel_output=False and runtime_gather_output=True pass the same gathered logits to the
    vocab-parallel cross-entropy: one finding with both triggers; the smoothing fix tried on it
    does not repair it, so it shows no fix."""
    from shardcheck.megatron.audit.report import control_line

    [gathered] = [f for f in pair.findings if f.trigger["options"] == dict(GATHERED)]
    assert [(s["options"], s["layout"]) for s in gathered.same_fix] == [(dict(RUNTIME_GATHERED), "tp2-sp")]
    assert gathered.checker.startswith("checker: double count at megatron/core/tensor_parallel/cross_entropy.py:")
    assert control_line(gathered) == "no verified fix (the fix tried leaves the outputs differing)"
    assert gathered.title.startswith("a SUM all-reduce of a replicated value adds n copies"), gathered.title


@pytest.mark.slow
def test_one_bug_reached_by_several_option_paths_is_one_finding(pair):
    [smoothing] = [f for f in pair.findings if f.trigger["options"] == {"label_smoothing": 0.1}]
    assert {(c["layout"], tuple(c["options"])) for c in smoothing.cases} == {
        ("tp2", ("label_smoothing",)), ("tp2-sp", ("label_smoothing",)),
        ("tp2", ("label_smoothing", "runtime_gather_output"))}
    # 0.2 does not contain the trigger 0.1, but the same corrected function repairs it
    assert [s["options"] for s in smoothing.same_fix] == [{"label_smoothing": 0.2}]
    assert smoothing.seen_in[0] == "layouts: tp2, tp2-sp"
    assert "1 option set that does not change this component" in smoothing.seen_in[1]


@pytest.mark.slow
def test_no_finding_holds_a_case_independent_of_its_trigger(pair, tmp_path):
    from shardcheck.megatron.audit import report as audit_report

    audit_report.write(tmp_path, pair.findings, pair.summary())
    data = json.loads((tmp_path / "findings.json").read_text())
    assert data["findings"] and all(independent_cases(f) == [] for f in data["findings"])
    assert data["coverage"]["output_loss"]["option_sets_run"] == 6
    assert data["coverage"]["output_loss"]["plain_layouts"] == ["tp2", "tp2-sp"]
    assert (tmp_path / "report.md").read_text().index("## Coverage") < \
        (tmp_path / "report.md").read_text().index("## Findings")


def test_independent_cases_names_a_case_that_lacks_the_trigger():
    finding = {"trigger": {"options": {"a": True}},
               "cases": [{"layout": "tp2", "options": {"a": True, "b": 1}}, {"layout": "tp2", "options": {}}]}
    assert independent_cases(finding) == [{"layout": "tp2", "options": {}}]


CARRIED_FINDINGS = Path(__file__).parent / "data" / "audit" / "findings.json"


def _findings_file(which: str) -> Path:
    """The carried findings.json of a real audit run (tests/data/audit/README.md), or the one
    ``$SHARDCHECK_AUDIT_FINDINGS`` names (e.g. ``audit-out/findings.json`` after ``make audit``)."""
    if which == "carried":
        return CARRIED_FINDINGS
    if not os.environ.get("SHARDCHECK_AUDIT_FINDINGS"):
        pytest.skip("set SHARDCHECK_AUDIT_FINDINGS to a default run's findings.json to check it too")
    return Path(os.environ["SHARDCHECK_AUDIT_FINDINGS"])


@pytest.mark.parametrize("which", ["carried", "SHARDCHECK_AUDIT_FINDINGS"])
def test_a_real_runs_findings_hold_no_case_independent_of_its_trigger(which):
    """Over a real audit run's findings.json: no finding's cases include one whose options lack its trigger's."""
    data = json.loads(_findings_file(which).read_text())
    assert data["findings"] and data["coverage"]
    assert {f["id"]: independent_cases(f) for f in data["findings"]} == {f["id"]: [] for f in data["findings"]}


def _cases(entries: list[dict]) -> frozenset:
    return frozenset((c["layout"], tuple(sorted(c["options"].items()))) for c in entries)


def test_causes_splits_the_carried_runs_failing_cases_into_its_findings_again():
    """The carried run (output_loss under tp2 and tp2-sp) has three findings at one place, one per
    independent option: causes() over all their failing cases gives those three causes again."""
    data = json.loads(CARRIED_FINDINGS.read_text())
    places: dict[tuple[str, str], list[frozenset]] = {}
    for finding in data["findings"]:
        found = [finding["cases"], *(same["cases"] for same in finding["same_fix"])]
        places.setdefault((finding["location"], finding["contract"]), []).extend(map(_cases, found))
    assert [len(found) for found in places.values()] == [3]
    for found in places.values():
        members = [_failing(tuple(options), layout) for cases in found for layout, options in cases]
        assert {_cases(audit_case_entries(cause)) for cause in causes(members)} == set(found)


def audit_case_entries(cause: list[Outcome]) -> list[dict]:
    return [{"layout": str(o.case.layout), "options": dict(o.case.options)} for o in cause]


def test_only_the_entry_point_and_the_gradient_norm_are_locations_of_last_resort():
    """A finding keyed by either takes its checker violation's line (docs/audit.md)."""
    norm = BY_NAME["get_grad_norm_fp32"].notation()
    assert audit_report.last_resort(("megatron/core/models/gpt/gpt_model.py:519", audit_report.ENTRY_CONTRACT))
    assert audit_report.last_resort(("megatron/core/optimizer/clip_grads.py:55", norm))
    upstream = BY_NAME["vocab_parallel_cross_entropy"]
    assert not upstream.downstream
    assert not audit_report.last_resort((upstream.location(), upstream.notation()))
    assert not audit_report.last_resort(("megatron/core/models/gpt/gpt_model.py:354", audit_report.GLOBAL_GROUP_CONTRACT))
