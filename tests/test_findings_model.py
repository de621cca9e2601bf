"""One Finding model for the fuzzer and the audit: the store's records and an audit's findings.json
entries are two views of it, and what either format holds (carried runs included) loads."""

import json
from pathlib import Path

import pytest

from shardcheck.fuzz.findings import AUDIT, STORED, Finding, FindingStore, show_number

DATA = Path(__file__).parent / "data"
CARRIED = sorted(DATA.glob("audit*/findings.json"))


def _audited(**changes) -> Finding:
    report = dict(title="loss differs under tp2", kind="type+numeric", location="megatron/core/a.py:7",
                  contract="loss matches", first_divergence="f#0.loss: differs", checker="checker: x",
                  reproduce="shardcheck audit --only gpt --layouts tp2 --set seq=4", seen_in=["layouts: tp2"],
                  cases=[{"layout": "tp2", "options": {"seq": 4}}])
    effect = [{"value": "loss", "observed": [[1.0, 2.0]], "reference": 0.5, "max_abs_error": 1.5,
               "max_rel_error": 3.0}]
    control = {"fix": "sum, not mean", "result": "corrected == reference", "equal_to_reference": True,
               "max_abs_error": 0.0}
    return Finding.audited({"component": "gpt", "options": {"seq": 4}, "layout": "tp2"}, effect, control,
                           **{**report, **changes})


@pytest.mark.parametrize("path", CARRIED, ids=lambda p: p.parent.name)
def test_every_carried_findings_json_entry_loads_and_shows_again_as_it_was(path):
    assert CARRIED, "tests/data/audit*/findings.json are carried"
    for entry in json.loads(path.read_text())["findings"]:
        finding = Finding.from_report(entry)
        assert finding.origin == AUDIT and finding.id == entry["id"] and finding.trigger == entry["trigger"]
        shown = finding.report_entry()
        assert {key: shown[key] for key in entry} == entry


def test_an_audit_finding_is_stored_as_the_store_always_kept_it_and_loads_back(tmp_path):
    finding = _audited()
    record = json.loads(finding.to_json())
    assert tuple(record) == STORED
    assert record["observed"] == show_number([[1.0, 2.0]]) == "shape [1, 2] [1, 2, ...]"
    assert (record["reference"], record["max_error"]) == ("0.5", 1.5)
    assert record["corrected"] == "corrected == reference" and record["config"] == {"seq": 4}
    assert record["target"] == "gpt" and record["options"] == ["seq"] and record["origin"] == AUDIT
    store = FindingStore(tmp_path)
    assert store.save(finding)
    loaded = store.load(finding.id)
    assert (loaded.id, loaded.cause, loaded.config, loaded.corrected) == (finding.id, finding.cause, {"seq": 4},
                                                                         "corrected == reference")
    # the report stays in findings.json; the corrected control is kept: a script's --fixed is its fix
    assert loaded.effect == [] and loaded.control == finding.control is not None


def test_an_audit_findings_json_entry_round_trips():
    finding = _audited(same_fix=[{"component": "gpt", "options": {"seq": 8}, "layout": "tp2"}])
    entry = json.loads(json.dumps(finding.report_entry()))
    assert list(entry) == ["title", "kind", "location", "contract", "trigger", "effect", "first_divergence",
                           "checker", "corrected", "reproduce", "seen_in", "id", "repro", "cases", "same_fix",
                           "one_rank", "training_args", "first_op", "showed"]
    assert entry["corrected"] == finding.control and entry["trigger"] == {"component": "gpt",
                                                                        "options": {"seq": 4}, "layout": "tp2"}
    again = Finding.from_report(entry)
    assert again.report_entry() == entry and again.to_json() == finding.to_json()


def test_a_crash_has_no_numbers_in_the_store():
    crash = _audited(kind="crash", one_rank="RuntimeError: boom (frame x); the same runs on one rank")
    bare = Finding.audited(crash.trigger, [], None, **{k: v for k, v in crash.report_entry().items()
                                                      if k not in ("trigger", "effect", "corrected")})
    record = json.loads(bare.to_json())
    assert (record["observed"], record["reference"], record["corrected"], record["max_error"]) == (None,) * 4
    assert bare.one_rank.startswith("RuntimeError")
