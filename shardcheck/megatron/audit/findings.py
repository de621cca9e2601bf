"""The findings of an audit's outcomes: one per root cause, each with its corrected control.

Failing cases are grouped by place (:func:`shardcheck.megatron.audit.report.group`) and split
by trigger (:func:`~shardcheck.megatron.audit.report.causes`); independent triggers that one fix
repairs are one cause. Cases that crash under a layout while one rank runs them are findings of
their own, located at their innermost megatron-core frame. A finding whose trigger
megatron.training's argument validation refuses says so, with the line
(:mod:`~shardcheck.megatron.audit.training_args`).
"""

from __future__ import annotations

import re
from typing import Any

from shardcheck.fuzz.findings import Finding, finding_id
from shardcheck.megatron.audit import report as audit_report
from shardcheck.megatron.audit.operands import SHAPE_ERROR, operand_root
from shardcheck.megatron.audit.outcome import Outcome
from shardcheck.megatron.audit.param_layouts import mismatched_layout
from shardcheck.megatron.audit.runner import Runner
from shardcheck.megatron.audit.sweep import Case
from shardcheck.megatron.audit.training_args import crash_training_verdict, training_verdict
from shardcheck.megatron.checks import contracts, explicit, piece_gradients
from shardcheck.megatron.scenarios.reference import recorded_at


def build_findings(runner: Runner, outcomes: list[Outcome], one_rank: list[Outcome]) -> list[Finding]:
    """One finding per root cause: failing cases grouped by place, split by trigger
    (:func:`audit_report.causes`); independent triggers that one fix repairs are one cause.
    ``one_rank``: the option sets whose one-rank reference raised (a run's, or its shares')."""
    baseline = {(o.case.component, o.case.layout): {audit_report.violation_key(v) for v in o.violations}
                for o in outcomes if not o.case.options}
    outcomes = sorted(outcomes, key=lambda o: (o.case.component, audit_report.case_size(o.case),
                                               repr(o.case.options)))
    findings = []
    for key, members in audit_report.group([o for o in outcomes if o.failed]).items():
        built = [_finding(runner, key, cause, baseline, first=n == 0)
                 for n, cause in enumerate(audit_report.causes(members))]
        findings += _merged_causes(built)
    findings += [_crash_finding(runner, key, cause, first=n == 0)
                 for key, members in [*_crashes(outcomes).items(), *_one_rank_crashes(one_rank).items()]
                 for n, cause in enumerate(_crash_causes(members))]
    return _unique_ids(sorted(findings, key=lambda f: (f.kind, f.location, f.id)))


def _finding(runner: Runner, key: tuple[str, str], members: list[Outcome],
             baseline: dict, first: bool) -> Finding:
    minimal = audit_report.minimal_case(members)
    seen = baseline.get((minimal.case.component, minimal.case.layout), set())
    violation = audit_report.checker_violation(key[0], [minimal, *members], seen if minimal.case.options else set())
    checker = violation["line"] if violation else None
    kind = audit_report.kind(members, checker)
    narrowed = runner.first_op(minimal.case, minimal.call_gap) if kind == "numeric-only" else None
    location = narrowed.location if narrowed is not None and key[1] != audit_report.NORM_CONTRACT else key[0]
    located = None
    if violation is not None and audit_report.last_resort(key):  # the checker's line is nearer the root
        located = runner.located_violation(minimal.case, violation)
        violation = located or violation
        location, checker = violation["location"], violation["line"]
    location = (_metric_record(minimal) if kind == "numeric-only" else None) or location
    control = corrected_control(runner, minimal, located)
    title = audit_report.title(key, minimal, checker)
    explained = (control and control.get("equal_to_reference")) or minimal.call_gap is not None \
        or audit_report.global_group_use(minimal) is not None
    if not explained and (mismatch := mismatched_layout(runner.pools, minimal)) is not None:
        location = mismatch.location or location
        title = f"{mismatch.title(minimal.case.layout)} ({_options_text(audit_report.trigger(minimal.case))})"
    return Finding.audited(
        audit_report.trigger(minimal.case), audit_report.effect(minimal), control,
        title=title, kind=kind,
        location=location, contract=key[1], first_op=narrowed.line() if narrowed is not None else None,
        showed=key[0] if location != key[0] else audit_report.shown_at(key, minimal),
        first_divergence=minimal.call_gap.gap.summary() if minimal.call_gap else None,
        checker=checker, reproduce=audit_report.reproduce_command(minimal.case),
        seen_in=audit_report.seen_in(members, minimal),
        cases=[audit_report.case_entry(o.case, minimal.case.component) for o in members],
        id="" if first else _trigger_id(key, minimal.case), training_args=training_verdict(minimal.case))


def _metric_record(outcome: Outcome) -> str | None:
    """``file:line`` of the megatron-core call that recorded the first diverging metric in its
    tracker, where only metrics the training loop logs differ (no loss, gradient or contracted
    result): each rank records its share of a metric, which the groups that call gives the
    tracker make whole, so the call is the root; the first op whose share differs from the
    one-rank value is not (Megatron-LM 4abeecce74: the z-loss recorded without ``avg_group``).
    None otherwise."""
    if outcome.call_gap is not None or not outcome.gaps:
        return None
    sites = [recorded_at(outcome.declared, gap.name) for gap in outcome.gaps]
    return None if None in sites else sites[0].split(" in ", 1)[0]


def _trigger_id(key: tuple[str, str], case: Case) -> str:
    """The id of a second cause at one place: its trigger's option names join the hash."""
    return finding_id(key[0], "\0".join([key[1], *sorted(name for name, _ in case.options)]))


def _unique_ids(findings: list[Finding]) -> list[Finding]:
    """The findings, each with an id of its own: an id hashes the location, the contract and the
    trigger's option names, so two causes at one place whose triggers set one option to two
    values (``position_embedding=none``, ``=mrope``) would share one; the later one's id hashes
    its options' values too."""
    taken: set[str] = set()
    for finding in findings:
        if finding.id in taken:
            finding.id = finding_id(finding.location, finding.contract,
                                    [f"{name}={value}" for name, value in finding.config.items()])
        taken.add(finding.id)
    return findings


def _merged_causes(found: list[Finding]) -> list[Finding]:
    """Causes at one place whose triggers are independent but which are one bug: the same
    corrected function repairs each (each corrected control equals the reference), or each
    breaks the same type rule at the same line (the gathered logits that ``parallel_output=False``
    and ``runtime_gather_output=True`` both pass to the vocab-parallel cross-entropy; the router's
    token count that the MoE model's ``padding_mask`` and the router's own padding both reach,
    one repaired by the fix, one not). Causes sharing either join (:func:`_same_causes`). One of
    them, a verified one when any is, keeps the others' triggers and cases under ``same_fix``."""
    kept = []
    for joined in _same_causes(found):
        host = next((f for f in joined if audit_report.verified(f)), joined[0])
        for finding in (f for f in joined if f is not host):
            _join(host, finding)
        kept.append(host)
    return kept


def _same_causes(found: list[Finding]) -> list[list[Finding]]:
    """The causes that are one bug, in order: those sharing a key of :func:`_cause_keys` (with
    any of its members, so a chain of shared keys joins)."""
    joined: list[list[Finding]] = []
    owner: dict[tuple[str, str], int] = {}
    for finding in found:
        keys = _cause_keys(finding)
        hits = sorted({owner[k] for k in keys if k in owner})
        if not hits:
            joined.append([])
            hits = [len(joined) - 1]
        into = hits[0]
        for other in reversed(hits[1:]):  # a finding that shares keys with two: both are one bug
            joined[into] += joined[other]
            joined[other] = []
        joined[into].append(finding)
        for member in joined[into]:
            owner.update((k, into) for k in _cause_keys(member))
    return [causes for causes in joined if causes]


def _join(host: Finding, finding: Finding) -> None:
    """Note an independent trigger of the host's bug on the host: its trigger and cases, and
    what its corrected control gave (shown only when the fix repaired it)."""
    verified = audit_report.verified(finding)
    host.same_fix.append({**finding.trigger, "cases": finding.cases,
                          "corrected": finding.control["result"] if verified else None})
    layouts = sorted({c["layout"] for c in finding.cases})
    shared = _cause_keys(host) & _cause_keys(finding)
    why = "the same fix repairs" if any(kind == "fix" for kind, _ in shared) else "the same violation shows for"
    tried = "" if verified or not finding.control else f"; the fix tried there: {finding.control['result']}"
    host.seen_in.append(f"{why} the independent trigger {_options_text(finding.trigger)} "
                        f"(under {', '.join(layouts)}{tried})")


def _cause_keys(finding: Finding) -> set[tuple[str, str]]:
    """What makes two causes at one place one: the fix that repaired it (verified), and the type
    rule and line its checker line names; none when neither is known."""
    keys = set()
    if audit_report.verified(finding):
        keys.add(("fix", finding.control["fix"]))
    if finding.checker:
        keys.add(("checker", finding.checker.removeprefix("checker: ").split(" in ", 1)[0]))
    return keys


def _options_text(trigger: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in trigger["options"].items()) or "defaults"


CRASH_CONTRACT = "runs under the layout as it runs on one rank"


def _crashes(outcomes: list[Outcome]) -> dict[tuple[str, str], list[Outcome]]:
    """Cases that raised or hung under their layout while one rank runs them, by place: their
    innermost megatron-core frame and exception type (else the component's entry point)."""
    found: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in (o for o in outcomes if o.crashed and o.reference_digest is not None):
        where = outcome.frame or outcome.entry or f"{outcome.case.component} (no megatron-core frame)"
        what = outcome.error.split(":", 1)[0] if outcome.error_kind == "error" else outcome.error_kind
        found.setdefault((where.split(" in ")[0], f"{CRASH_CONTRACT} ({what})"), []).append(outcome)
    return found


ONE_RANK_CONTRACT = "runs on one rank"
ONE_RANK_CRASH = "one-rank crash"  # the kind of a crash in megatron-core's code that needs no layout


def _one_rank_crashes(failures: list[Outcome]) -> dict[tuple[str, str], list[Outcome]]:
    """Option sets whose one-rank reference raised in megatron-core's own code, not refusing
    their arguments (:attr:`Outcome.one_rank_crash`), by place: the innermost megatron-core
    frame and the exception type."""
    found: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in (o for o in failures if o.one_rank_crash and o.frame):
        what = outcome.error.split(":", 1)[0]
        found.setdefault((outcome.frame.split(" in ")[0], f"{ONE_RANK_CONTRACT} ({what})"), []).append(outcome)
    return found


def _crash_causes(members: list[Outcome]) -> list[list[Outcome]]:
    """The causes of the crashes at one place, those that raise the same message (its numbers
    aside) joined: one bug that several independent triggers reach (megatron-core's in-place write
    to gathered logits, through each model's ``parallel_output=False`` and
    ``runtime_gather_output=True``)."""
    joined: dict[str, list[Outcome]] = {}
    for cause in audit_report.causes(members):
        message = re.sub(r"\d+", "#", audit_report.minimal_case(cause).error or "")
        joined.setdefault(message, []).extend(cause)
    return list(joined.values())


def _crash_finding(runner: Runner, key: tuple[str, str], members: list[Outcome], first: bool) -> Finding:
    """A crash under a layout while one rank runs the case, or (a one-rank outcome) a crash in
    megatron-core's code on one rank, which gets a script that raises it. A shape error is
    located where megatron-core made the ill-shaped operand, when another function made it
    (:func:`~shardcheck.megatron.audit.operands.operand_root`); the raising line is where it
    showed."""
    minimal = audit_report.minimal_case(members)
    case = minimal.case
    root = operand_root(runner.pools, case) if SHAPE_ERROR.search(minimal.error or "") else None
    alone = case.layout.world_size == 1
    where = "on one rank" if alone else f"under {case.layout}"
    return Finding.audited(
        audit_report.trigger(case), [], None,
        title=f"{case.component} {minimal.error_kind} {where} "
              f"({_options_text(audit_report.trigger(case))}): {minimal.error}"[:240],
        kind=ONE_RANK_CRASH if alone else "crash", location=root[0] if root else key[0], contract=key[1],
        showed=key[0] if root else None,
        reproduce=audit_report.reproduce_command(case), seen_in=audit_report.seen_in(members, minimal),
        cases=[audit_report.case_entry(o.case) for o in members],
        id="" if first else _trigger_id(key, case),
        training_args=crash_training_verdict(case) if alone else training_verdict(case),
        one_rank=f"{minimal.error} (frame {minimal.frame or 'outside megatron-core'}); " + (
            "megatron-core raises it in its own code on one rank, with no layout (its arguments "
            "pass its checks); the component runs on one rank without these options" if alone
            else "the same component and options run on one rank"))


def _fix_of(minimal: Outcome, located: dict | None) -> tuple[str, str] | None:
    """The fix to apply (name, note): explicit groups for a global-group use, the contract's,
    else that of the checker's violation ``located`` at its forward line (a piece's gradient
    left partial at a split: :mod:`piece_gradients`)."""
    if audit_report.global_group_use(minimal) is not None:
        return explicit.FIX, explicit.FIX_NOTE
    if minimal.call_gap is None or contracts.BY_NAME[minimal.call_gap.contract].fix is None:
        return piece_gradients.fix_for(located)
    contract = contracts.BY_NAME[minimal.call_gap.contract]
    return contract.name, contract.fix_note


REPAIRED = "corrected == reference"  # a corrected control's verdict when the fix repairs the finding


def corrected_control(runner: Runner, minimal: Outcome, located: dict | None = None) -> dict[str, Any] | None:
    """Rerun the minimal trigger with its fix patched in, compared with the reference
    (``located``: its checker violation at its forward line, see :func:`_fix_of`)."""
    fix = _fix_of(minimal, located)
    if fix is None:
        return None
    fix_name, note = fix
    fixed = runner.run(minimal.case, fixes=(fix_name,))
    if fixed.error:
        return {"fix": note, "name": fix_name, "result": f"the corrected run failed: {fixed.error}",
                "equal_to_reference": False}
    names = [g.name for g in minimal.gaps]
    errors = {name: fixed.errors.get(name) for name in names}
    worst = max((e for e in errors.values() if e is not None), default=0.0)
    ok = not fixed.gaps and fixed.call_gap is None
    verdict = REPAIRED
    if not ok:  # outputs still differ, else the contracted result the fix was to repair
        differing = [g.name for g in fixed.gaps[:3]] or [fixed.call_gap.gap.name]
        verdict = f"still differs: {', '.join(differing)}"
    return {"fix": note, "name": fix_name, "result": f"{verdict} (max abs error of the diverging outputs "
            f"{worst:.3g} after the fix)", "equal_to_reference": ok, "max_abs_error": worst}
