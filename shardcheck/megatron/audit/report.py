"""Findings of an audit: failing cases deduplicated by location and contract, and their report.

A failing case is *located* by the first contracted call that diverges (the contract names the
function and its file:line in megatron-core) or by the type checker's first violation. Cases
that fail without a location (e.g. data-parallel layouts, where contracted calls are not
aligned with the one-rank run) join the finding of the same component and options found
elsewhere, or else form a finding located at their first diverging output.

The minimal trigger of a finding is its failing case with the fewest ranks, then the fewest
options. ``kind`` is ``type+numeric`` when both parity and the checker saw it, ``numeric-only``
when only parity did, ``type-only`` when only the checker did. Parity sees a case
(:func:`numeric`) when an output differs from the one-rank run, or the result of a contracted
call does: the quantity its contract ensures, rebuilt from every rank (a local token count read
after an in-place all-reduce moves no output unless the loss scales by it, yet is twice the
one-rank count).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardcheck.fuzz.findings import Finding, show_number
from shardcheck.megatron.audit.sweep import Case
from shardcheck.megatron.checks.contracts import BY_NAME
from shardcheck.parity.layout import Layout
from shardcheck.typecheck.gradient_rules import MISDECLARED, MISMATCH, UNREDUCED

GLOBAL_GROUP_CONTRACT = ("collectives of a model given a pg_collection use its groups: a value "
                         "laid out over pg_collection.X is reduced over pg_collection.X, not over "
                         "parallel_state's global X group")


def global_group_use(outcome) -> dict | None:
    """The first collective the outcome issued on a global group its explicit groups replace,
    at the first line of the function that chose that group (a constructor that builds two
    layers without it is one place, whichever layer's collective ran first under a layout)."""
    from shardcheck.megatron.checks.explicit import RULE

    uses = [v for v in outcome.violations if v["rule"] == RULE]
    if not uses:
        return None
    first = uses[0]
    place = (first["location"].rsplit(":", 1)[0], first.get("function"))
    return min((v for v in uses if (v["location"].rsplit(":", 1)[0], v.get("function")) == place),
               key=lambda v: int(v["location"].rsplit(":", 1)[1]))


def violation_key(violation: dict) -> tuple[str, str]:
    return violation["location"], f"checker rule: {violation['rule']}"


NORM_CONTRACT = ("a parameter cut over tp is declared so (tensor_model_parallel), and the gradient "
                 "norm counts every rank's piece of it")
GRADIENT_CONTRACT = ("a parameter's reduced gradient has its parameter's type (reduced over every axis "
                     "it is replicated on), as megatron-core builds the parameter")


REDUCTION_CONTRACT = ("a parameter's allreduce picks the DDP buffer (dense or expert) whose group sums its "
                      "gradient over every rank it varies on")


# the contract of a numeric finding located by nothing but its entry point into megatron-core
ENTRY_CONTRACT = "outputs match the one-rank run"


def last_resort(key: tuple[str, str]) -> bool:
    """Whether ``key`` locates its finding only where any bug would show: its entry point into
    megatron-core, or a downstream contract (the gradient norm)."""
    contract = BY_NAME.get(key[1].split(":", 1)[0])
    return key[1] == ENTRY_CONTRACT or (contract is not None and contract.downstream)


def _key(outcome) -> tuple[str, str] | None:
    """Where an outcome is located: the line that chose a global group it used, else its first
    diverging contracted call upstream of the gradient norm, else the line that built a
    parameter whose gradient differs and breaks its type (:func:`_built_site`), else the line
    that declared the tensor parallelism of the parameter the norm miscounts, else the norm's
    own call; a parameter whose gradient differs and whose ``allreduce`` picked the other kind
    of DDP buffer is located before the built parameter, where that was set (:func:`_reduction_site`).
    None of them is a component's own line, so one bug reached through two
    components (a layer alone and in a model) is keyed, and found, once."""
    misuse = global_group_use(outcome)
    if misuse is not None:
        return misuse["location"], GLOBAL_GROUP_CONTRACT
    if outcome.call_gap is not None and not BY_NAME[outcome.call_gap.contract].downstream:
        contract = BY_NAME[outcome.call_gap.contract]
        return contract.location(), contract.notation()
    if (misgrouped := _reduction_site(outcome)) is not None:
        return misgrouped["location"], REDUCTION_CONTRACT
    if (built := _built_site(outcome)) is not None:
        return built, GRADIENT_CONTRACT
    if (declared := _declaration_site(outcome)) is not None:
        return declared, NORM_CONTRACT
    if outcome.call_gap is not None:
        contract = BY_NAME[outcome.call_gap.contract]
        return contract.location(), contract.notation()
    return None


# the checker's gradient rules, and the check that reports them where the parameter is built
GRADIENT_RULES = (UNREDUCED, MISDECLARED, MISMATCH)
_CHECKED_WHERE_BUILT = re.compile(r" in check_gradients: (\S+): parameter ")


def _built_site(outcome) -> str | None:
    """``file:line`` in megatron-core where a parameter was built whose gradient differs from
    the one-rank run and breaks the checker's gradient rules there: a violation the scenario
    reported where the parameter's module is built (``check_gradients`` at its construction
    site, not at the optimizer step every gradient reaches), for a ``grad/NAME`` that differs."""
    differs = {g.name.removeprefix("grad/") for g in outcome.gaps if g.name.startswith("grad/")}
    for violation in outcome.violations:
        named = _CHECKED_WHERE_BUILT.search(violation["line"])
        if violation["rule"] in GRADIENT_RULES and named and named.group(1) in differs:
            return violation["location"]
    return None


_MISGROUPED_PARAM = re.compile(r" in DistributedDataParallel: (\S+): allreduce=")


def _reduction_site(outcome) -> dict | None:
    """The checker's violation of a parameter whose gradient differs from the one-rank run and
    whose ``allreduce`` picked a DDP buffer whose group misses an axis it varies on
    (:mod:`~shardcheck.megatron.checks.reduction`): located where ``allreduce`` was set."""
    from shardcheck.megatron.checks.reduction import MISGROUPED

    differs = {g.name.removeprefix("grad/") for g in outcome.gaps if g.name.startswith("grad/")}
    return next((v for v in outcome.violations if v["rule"] == MISGROUPED
                 and (named := _MISGROUPED_PARAM.search(v["line"])) and named.group(1) in differs), None)


def shown_at(key: tuple[str, str], outcome) -> str | None:
    """Where a finding located at a declaration (:data:`REDUCTION_CONTRACT`) showed: its first
    diverging contracted call (the gradient norm), else None."""
    if key[1] != REDUCTION_CONTRACT or outcome.call_gap is None:
        return None
    return BY_NAME[outcome.call_gap.contract].location()


def _declaration_site(outcome) -> str | None:
    """``file:line`` in megatron-core where the parameter the norm miscounts got its tensor
    parallelism declared (:func:`norm_declaration`), else None."""
    found = _miscounted(outcome)
    if found is None:
        return None
    site = re.search(r"(megatron/core/\S+?\.py:\d+)", found[1])
    return site.group(1) if site else None


def numeric(outcome) -> bool:
    """Whether parity saw the outcome: an output, or a contracted call's result, differs from
    the one-rank run."""
    return bool(outcome.gaps) or outcome.call_gap is not None


def case_size(case: Case) -> tuple:
    return case.layout.world_size, len(case.options), str(case.layout)


def _downstream(outcome) -> bool:
    """Whether the outcome is located only by a downstream contract (the gradient norm)."""
    contract = BY_NAME[outcome.call_gap.contract] if outcome.call_gap is not None else None
    return (contract is not None and contract.downstream
            and _key(outcome) == (contract.location(), contract.notation()))


def group(failed: Sequence) -> dict[tuple[str, str], list]:
    """Failing outcomes grouped by (location, contract).

    A numeric failure located by a contracted call of its own is keyed by it: two bugs of one
    component and options (e.g. one under cp, one under pp) are two findings. The others (not
    located, or located only downstream, e.g. by the gradient norm that every gradient bug
    reaches, or under data parallelism, where the call that causes it is not compared) join
    the finding of the same component and options: the key of its smallest case located
    upstream, else downstream, else the entry point into megatron-core of its smallest case.
    Findings of different options that share a key are one. Type-only outcomes are keyed by
    their violation, unless a numeric finding's cases have the same violation: they explain it.
    """
    seen = [o for o in failed if numeric(o)]
    by_options: dict[tuple, tuple[str, str]] = {}
    for outcome in sorted(seen, key=lambda o: (_key(o) is None, _downstream(o), case_size(o.case))):
        by_options.setdefault((outcome.case.component, outcome.case.options), _key(outcome) or (
            outcome.entry or f"{outcome.case.component} output {outcome.gaps[0].name}",
            ENTRY_CONTRACT))
    groups: dict[tuple[str, str], list] = {}
    for outcome in seen:
        own = None if _downstream(outcome) else _key(outcome)
        groups.setdefault(own or by_options[(outcome.case.component, outcome.case.options)],
                          []).append(outcome)
    explained = {violation_key(v): key for key, members in groups.items()
                 for o in members for v in o.violations if _explains(key, v)}
    for outcome in (o for o in failed if not numeric(o)):
        for violation in outcome.violations:
            groups.setdefault(explained.get(violation_key(violation), violation_key(violation)),
                              []).append(outcome)
    return groups


def _options(outcome) -> frozenset:
    return frozenset(outcome.case.options)


def causes(members: Sequence) -> list[list]:
    """Split the failing outcomes of one place (location, contract) into root causes.

    Two cases share a cause only when one's trigger contains the other's: the same options (under
    any layout), or a superset of options whose smaller set already fails here under the same
    layout (the defaults diverging here cover every option under that layout). A case whose
    options contain no failing case's starts a cause of its own. Numeric failures come first,
    so a cause's smallest trigger is a numeric one when it has any.
    """
    ordered = sorted(members, key=lambda o: (not numeric(o), len(o.case.options), case_size(o.case)))
    found: list[list] = []
    owner: dict[frozenset, int] = {}
    placed: dict[tuple[frozenset, str], int] = {}
    for outcome in ordered:
        options, layout = _options(outcome), str(outcome.case.layout)
        index = owner.get(options)
        if index is None:
            index = next((i for (smaller, where), i in placed.items()
                          if where == layout and smaller < options), None)
        if index is None:
            found.append([])
            index = len(found) - 1
        owner.setdefault(options, index)
        placed.setdefault((options, layout), index)
        found[index].append(outcome)
    return found


def minimal_case(members: Sequence):
    """The trigger of a cause: a numeric failure before a typed one, then the fewest ranks and options."""
    return min(members, key=lambda o: (not numeric(o), case_size(o.case)))


def case_entry(case: Case, component: str | None = None) -> dict[str, Any]:
    """A case as findings.json lists it; one of another component than the finding's
    (``component``: one bug reached through a layer and a model that holds it) names its own."""
    entry = {"layout": str(case.layout), "options": dict(case.options)}
    return entry if case.component == (component or case.component) else {"component": case.component, **entry}


def seen_in(members: Sequence, minimal) -> list[str]:
    """What a person reads: the layouts, the option sets that change the result, and a count
    of the option sets that leave this component's one-rank outputs as the trigger's."""
    layouts = sorted({str(o.case.layout) for o in members}, key=lambda t: (Layout.parse(t).world_size, t))
    lines = [f"layouts: {', '.join(layouts)}"]
    others = sorted({o.case.component for o in members} - {minimal.case.component})
    if others:
        lines.append(f"components: {minimal.case.component}, and through {', '.join(others)}")
    base = minimal.reference_digest
    changing = sorted({_show_options(o.case.options) for o in members
                       if o.case.options != minimal.case.options and o.reference_digest != base})
    same = {o.case.options for o in members
            if o.case.options != minimal.case.options and o.reference_digest == base}
    if changing:
        lines.append(f"options that change the result: {'; '.join(changing)}")
    if same:
        lines.append(f"and {len(same)} option set{'s that do' if len(same) > 1 else ' that does'} not "
                     f"change this component (its one-rank outputs equal the trigger's)")
    return lines


def independent_cases(finding: dict[str, Any]) -> list[dict[str, Any]]:
    """The cases of a finding (as findings.json holds it) whose options do not contain its
    trigger's: none, when each finding is one root cause."""
    trigger = finding["trigger"]["options"].items()
    return [case for case in finding["cases"] if not trigger <= case["options"].items()]


def _show_options(options: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in options) or "defaults"


def _explains(key: tuple[str, str], violation: dict) -> bool:
    """Whether a numeric finding explains a violation its cases have: a global-group finding
    explains only global-group uses (its cases may break other rules for other reasons)."""
    from shardcheck.megatron.checks.explicit import RULE

    return key[1] != GLOBAL_GROUP_CONTRACT or violation["rule"] == RULE


def checker_violation(location: str, members: Sequence, baseline_violations: set[tuple[str, str]]) -> dict | None:
    """The violation explaining a finding (its ``checker:`` line): one of any of its cases at
    the finding's own line, else in its file, else one that its trigger case (the first member)
    has and the same component's default run under that layout has not (another case's
    violation elsewhere may be another bug's)."""
    file = location.rsplit(":", 1)[0]
    same_file = [v for o in members for v in o.violations if v["location"].rsplit(":", 1)[0] == file]
    same_line = [v for v in same_file if v["location"] == location]
    new = [v for v in members[0].violations if violation_key(v) not in baseline_violations]
    return (same_line or same_file or new or [None])[0]


def reproduce_command(case: Case) -> str:
    sets = " ".join(f"--set {name}={value.name if isinstance(value, enum.Enum) else value}"
                    for name, value in case.options)  # --set takes an Enum member by its name
    return f"shardcheck audit --only {case.component} --layouts {case.layout} {sets}".rstrip()


def trigger(case: Case) -> dict[str, Any]:
    return {"component": case.component, "options": dict(case.options), "layout": str(case.layout)}


NORM_COUNTED = "norm_counted/"


def title(key: tuple[str, str], minimal, checker: str | None = None) -> str:
    """What is wrong, in words: a global-group use names the group and where it was chosen; a
    parameter the gradient norm miscounts, where its tensor parallelism was declared; a numeric
    divergence its first diverging value, opened by the rule its ``checker`` line names (in
    words, :data:`~shardcheck.typecheck.violations.HELP`) where it has one."""
    case = minimal.case
    opts = ", ".join(f"{k}={v}" for k, v in case.options) or "default options"
    if (misuse := global_group_use(minimal)) is not None:
        return (f"{misuse['op']} on parallel_state's global {misuse['group']} group instead of the "
                f"model's pg_collection.{misuse['group']}{_chosen(misuse)} under {case.layout} ({opts})")
    if key[1] == REDUCTION_CONTRACT and (misgrouped := _reduction_site(minimal)) is not None:
        shown = (f"{minimal.call_gap.contract}: {minimal.call_gap.gap.name.split('.', 1)[1]}" if minimal.call_gap
                 else minimal.gaps[0].name)
        what = misgrouped["line"].split(" in DistributedDataParallel: ", 1)[1]
        return f"{what}, so {shown} differs from one rank under {case.layout} ({opts})"
    if key[1] == NORM_CONTRACT and (found := _miscounted(minimal)) is not None:
        return f"the gradient norm miscounts {found[0]}, which {found[1]}, under {case.layout} ({opts})"
    if minimal.call_gap is not None:
        what = minimal.call_gap.gap.name.split(".", 1)[1]
        return (f"{rule_words(checker)}{minimal.call_gap.contract}: {what} differs from one rank under "
                f"{case.layout} ({opts})" + norm_declaration(minimal))
    if minimal.gaps:
        return (f"{rule_words(checker)}{case.component}: {minimal.gaps[0].name} differs from one rank under "
                f"{case.layout} ({opts})" + norm_declaration(minimal))
    return f"{minimal.violations[0]['rule']} in {case.component} under {case.layout} ({opts})"


def rule_words(checker: str | None) -> str:
    """A title's opening from a ``checker:`` line: what its rule says is wrong, the rule and
    where (``''`` for no line, or a rule without words)."""
    from shardcheck.typecheck.violations import HELP

    rule, _, rest = (checker or "").removeprefix("checker: ").partition(" at ")
    if rule not in HELP:
        return ""
    return f"{HELP[rule][0]} ({rule} at {rest.split(' in ', 1)[0]}), so "


def _chosen(misuse: dict) -> str:
    """Where a global-group use's group was chosen, and where the collective showed, as a
    title's words ('' for a record without them, or one chosen where it was issued)."""
    function, showed = misuse.get("function"), misuse.get("showed")
    if not function or showed == misuse["location"]:
        return f" in {function}" if function else ""
    made = "builds the layer" if function.endswith(".__init__") else "makes the call"
    return f": {function} {made} without it (issued at {showed})"


def norm_declaration(outcome) -> str:
    """Where megatron-core declared the tensor parallelism of the parameter the outcome's
    gradient norm counts furthest off (which the norm reads), as a title's tail; else ''.

    A parameter is miscounted when its ``norm_counted/KEY`` output (its squared gradient as
    clipped) is off by more than :data:`MISCOUNT` beyond the clipping factor's change (which
    scales every parameter alike), while its gradient (``grad/KEY``) is right.
    """
    found = _miscounted(outcome)
    return f"; the norm counts {found[0]}, which {found[1]}" if found else ""


def _miscounted(outcome) -> tuple[str, str] | None:
    """The parameter the outcome's gradient norm counts furthest off, and its declaration."""
    gaps = {g.name: g for g in outcome.gaps}
    clip = gaps.get("clip_factor")
    scale = _ratio(clip) ** 2 if clip is not None else 1.0
    off = {g.name[len(NORM_COUNTED):]: abs(_ratio(g) / scale - 1) for g in outcome.gaps
           if g.name.startswith(NORM_COUNTED) and f"grad/{g.name[len(NORM_COUNTED):]}" not in gaps}
    declared = getattr(outcome, "declared", {})  # outcomes of older shares have none
    return next(((name, declared[name]) for name in sorted(off, key=lambda n: -off[n])
                 if off[name] > MISCOUNT and name in declared), None)


MISCOUNT = 0.01  # a shard counted once instead of per rank is off by half or more


def _ratio(gap) -> float:
    """observed / reference of a scalar gap (nan when either is no number, or the reference 0)."""
    if isinstance(gap.observed, list) or isinstance(gap.reference, list) or not gap.reference:
        return float("nan")
    return gap.observed / gap.reference


def kind(outcomes: Sequence, checker: str | None) -> str:
    seen = any(numeric(o) for o in outcomes)
    return "type+numeric" if seen and checker else "numeric-only" if seen else "type-only"


def effect(outcome, limit: int = 3) -> list[dict[str, Any]]:
    gaps = sorted(outcome.gaps, key=lambda g: -g.relative)
    if outcome.call_gap is not None:
        gaps = [outcome.call_gap.gap, *gaps]
    return [{"value": g.name, "observed": g.observed, "reference": g.reference,
             "max_abs_error": g.max_error, "max_rel_error": g.relative} for g in gaps[:limit + 1]]


def write(out_dir: Path, findings: Sequence[Finding], summary: dict[str, Any], source=None) -> None:
    """``out_dir/findings.json`` and ``out_dir/report.md``, each opening with what was audited
    (a :class:`~shardcheck.megatron.cpu.source.MegatronSource`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"audited": source.as_dict() if source else None,
            "summary": {k: v for k, v in summary.items() if k != "coverage"},
            "coverage": summary.get("coverage", {}), "findings": [f.report_entry() for f in findings]}
    (out_dir / "findings.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (out_dir / "report.md").write_text(markdown(findings, summary, source))


def _finding_lines(n: int, f: Finding) -> list[str]:
    lines = [f"### {n}. {f.title}", "",
             f"- **id**: `{f.id}` ({f.kind})",
             f"- **location**: `{f.location}`",
             *([f"- **where it showed**: `{f.showed}`"] if f.showed else []),
             *([f"- **first op**: `{f.first_op.removeprefix('first op: ')}`"] if f.first_op else []),
             f"- **minimal trigger**: component `{f.trigger['component']}`, options "
             f"`{f.trigger['options'] or 'defaults'}`, layout `{f.trigger['layout']}`",
             f"- **contract**: `{f.contract}`",
             f"- **checker**: `{f.checker or 'no type violation recorded'}`"]
    if f.one_rank:
        lines.append(f"- **crash**: {f.one_rank}")
    if f.training_args:
        lines.append(f"- **training arguments**: {f.training_args}")
    if f.effect:
        lines += [f"- **first divergence**: {f.first_divergence or 'no contracted call diverged'}",
                  "- **effect** (observed vs one-rank reference):"]
        lines += [f"  - `{e['value']}`: observed {show_number(e['observed'])}, reference "
                  f"{show_number(e['reference'])}, max abs error {e['max_abs_error']:.3g} "
                  f"(relative {e['max_rel_error']:.3g})" for e in f.effect]
        lines.append(f"- **corrected control**: {control_line(f, fix=True)}")
    lines += ["- **seen in**:", *[f"  - {line}" for line in f.seen_in], f"- **reproduce**: `{f.reproduce}`"]
    if f.repro:
        lines.append(f"- **repro script**: {script_line(f, quote='`')}")
    return lines + [""]


def outputs_moved(f: Finding) -> bool:
    """Whether the finding's trigger moved an output of its component, not only a contracted
    call's result (its first effect when it has a first divergence): a script compares outputs."""
    return len(f.effect) > (1 if f.first_divergence else 0)


def verified(f: Finding) -> bool:
    """Whether the finding's corrected control ran and made the outputs equal to the reference:
    only then is its fix shown (else the finding has no verified fix)."""
    return bool(f.control and f.control.get("equal_to_reference"))


def control_line(f: Finding, fix: bool = False) -> str:
    """A finding's corrected control as the report shows it: its result (with the fix, when
    ``fix``) only where it ran and made the outputs equal to the reference, else that the
    finding has no verified fix."""
    if verified(f):
        return f"{f.control['fix']} -> {f.control['result']}" if fix else f.control["result"]
    if f.control:
        return "no verified fix (the fix tried leaves the outputs differing)"
    return "no verified fix (no fix to try for this place)"


def script_line(f: Finding, quote: str = "") -> str:
    """How to run a finding's script (the command between ``quote`` marks), or why it has none."""
    if f.repro is None or f.repro.startswith("no script: "):
        return "none" + (f": {f.repro.removeprefix('no script: ')}" if f.repro else "")
    nproc = Layout.parse(f.trigger["layout"]).world_size
    command = f"torchrun --standalone --nproc-per-node={nproc} {f.repro}"
    return f"{quote}{command}{quote} (exits 0 while the bug reproduces)"


CRASH = "crash"


def coverage_table(coverage: dict[str, dict[str, Any]]) -> list[str]:
    """The report's opening table: per component, where and with what it ran, and the share of
    megatron-core's op calls the checker typed (then per layout, with the most unknown sites)."""
    lines = ["| component | plain layouts | explicit-group layouts | option sets run | left out "
             "| not read (pruned) | cases | megatron-core ops typed |", "|---|---|---|---|---|---|---|---|"]
    for component, row in coverage.items():
        ops = row.get("megatron_ops")
        typed = f"{_percent(ops)} of {ops['calls']}" if ops else "-"
        lines.append(f"| {component} | {', '.join(row['plain_layouts']) or '-'} | "
                     f"{', '.join(row['explicit_layouts']) or '-'} | {row['option_sets_run']} | "
                     f"{row['option_sets_left_out']} | {row.get('options_not_read', 0)} | {row['cases']} "
                     f"| {typed} |")
    return lines + [""] + _ops_by_layout(coverage)


def _percent(ops: dict[str, Any]) -> str:
    return f"{100 * ops['typed_share']:.1f}%"


def _ops_by_layout(coverage: dict[str, dict[str, Any]]) -> list[str]:
    """Per component and layout: megatron-core's op calls typed, and where the unknown ones are."""
    rows = [(component, layout, ops) for component, row in coverage.items()
            for layout, ops in row.get("megatron_ops", {}).get("by_layout", {}).items()]
    if not rows:
        return []
    lines = ["Op calls made in megatron-core's files that got a type (an unknown type is never "
             "checked: a bug there is invisible):", "",
             "| component | layout | typed | op calls | most unknown at |", "|---|---|---|---|---|"]
    lines += [f"| {component} | {layout} | {_percent(ops)} | {ops['calls']} | "
              f"{'; '.join(f'`{site}`' for site in ops['unknown_at'][:3]) or '-'} |"
              for component, layout, ops in rows]
    return lines + [""] + _gaps(rows)


TYPED_ENOUGH = 0.99  # a layout typing less of megatron-core's op calls has its gaps named


def _gaps(rows: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Per component and layout typed below :data:`TYPED_ENOUGH`: the origins of its unknown
    op calls (the op that made the first unknown, and why), with the share each explains."""
    gaps = [(component, layout, ops, origin) for component, layout, ops in rows
            if ops["typed_share"] < TYPED_ENOUGH for origin in ops.get("unknown_from") or [{}]]
    if not gaps:
        return []
    lines = [f"Where the unknown types began, for each layout typed below {TYPED_ENOUGH:.0%} (the op "
             "that first gave no type, why, and the share of the layout's unknown op calls that "
             "followed from it):", "",
             "| component | layout | typed | unknown from | cause | share of unknown |", "|---|---|---|---|---|---|"]
    lines += [f"| {component} | {layout} | {_percent(ops)} | `{origin.get('origin', '-')}` | "
              f"{origin.get('cause', 'not traced')} | {100 * origin.get('share', 0):.1f}% |"
              for component, layout, ops, origin in gaps]
    return lines + [""]


def _listed_sections(summary: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The report's closing lists, titled; the configurations megatron-core refuses apart from
    the rest of ``not_applicable`` (which holds them too)."""
    refused = summary.get("refused") or []
    applicable = [entry for entry in summary.get("not_applicable") or [] if entry not in refused]
    return [("Not swept", summary.get("not_swept") or []), ("Not reached", summary.get("not_reached") or []),
            ("Not read", summary.get("not_read") or []),
            ("Configurations megatron-core refuses", refused), ("Not applicable", applicable),
            ("Errors", summary.get("errors") or [])]


def markdown(findings: Sequence[Finding], summary: dict[str, Any], source=None) -> str:
    confirmed = [f for f in findings if f.kind not in ("type-only", CRASH)]
    crashes = [f for f in findings if f.kind == CRASH]
    typed_only = [f for f in findings if f.kind == "type-only"]
    lines = ["# shardcheck audit of megatron-core", ""]
    if source is not None:
        lines += [f"Audited: {source.line()}", ""]
    if summary.get("coverage"):
        lines += ["## Coverage", ""] + coverage_table(summary["coverage"])
    lines += [f"- {k}: {v}" for k, v in summary.items() if not isinstance(v, list | dict)]
    for component, why in (summary.get("cannot run on this version") or {}).items():
        lines.append(f"- cannot run on this version: {component}: {why}")
    lines += ["", f"## Findings confirmed by parity ({len(confirmed)})", ""]
    for n, f in enumerate(confirmed, 1):
        lines += _finding_lines(n, f)
    lines += [f"## Crashes only a layout causes: one rank runs the same case ({len(crashes)})", ""]
    for n, f in enumerate(crashes, len(confirmed) + 1):
        lines += _finding_lines(n, f)
    lines += [f"## Type-only findings: the checker objects, parity sees no wrong value ({len(typed_only)})",
              "", "Each is a rule a value breaks without changing the result in this run (a latent bug, or "
              "a layout the checker cannot express yet: report it to the checker if parity keeps agreeing).", ""]
    for n, f in enumerate(typed_only, len(confirmed) + len(crashes) + 1):
        lines += _finding_lines(n, f)
    for title, entries in _listed_sections(summary):
        if entries:
            lines += [f"## {title} ({len(entries)})", ""] + [f"- {entry}" for entry in entries] + [""]
    patches = summary.get("cpu patches") or {}
    if patches:
        lines += [f"## CPU patches ({len(patches)})", ""]
        lines += [f"- {name}: {status}" for name, status in patches.items()] + [""]
    return "\n".join(lines)
