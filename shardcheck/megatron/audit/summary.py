"""An audit's result (:class:`AuditResult`): its findings, what ran, what was left out and
why, and the summary and coverage the report opens with."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shardcheck.fuzz.findings import Finding
from shardcheck.megatron.audit.outcome import CONFIG_REFUSES, Outcome, op_counts
from shardcheck.megatron.audit.runner import FAILS
from shardcheck.megatron.audit.schedule import NOT_REACHED
from shardcheck.megatron.audit.training_args import REFUSES


@dataclass
class AuditResult:
    """Everything an audit found and ran."""

    findings: list[Finding]
    outcomes: list[Outcome]
    not_swept: list[str]
    seconds: float
    stopped_early: bool
    not_applicable: list[str] = field(default_factory=list)
    patches: dict[str, str] = field(default_factory=dict)  # CPU patch: applied / not needed
    unavailable: dict[str, str] = field(default_factory=dict)  # component: why it cannot run
    left_out: dict[tuple, str] = field(default_factory=dict)  # (component, options) -> why
    not_read: dict[str, list[str]] = field(default_factory=dict)  # component -> option sets pruned
    pruned: dict[tuple, list[str]] = field(default_factory=dict)  # (component, options) -> layouts
    left_to_full: dict[tuple, int] = field(default_factory=dict)  # (component, options) -> cases
    one_rank: list[Outcome] = field(default_factory=list)  # option sets whose one-rank reference raised
    unreached: dict[tuple, list[str]] = field(default_factory=dict)  # (component, options) -> layouts

    @property
    def errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]

    @property
    def not_reached(self) -> int:
        """The option sets the budget or time limit left without a single case."""
        return sum(1 for why in self.left_out.values() if why.startswith(NOT_REACHED))

    @property
    def refused(self) -> list[str]:
        """The entries of ``not_applicable`` that megatron-core's argument checks refused."""
        return [entry for entry in self.not_applicable if f": {CONFIG_REFUSES}: " in entry]

    def summary(self) -> dict[str, Any]:
        ran = [o for o in self.outcomes if not o.error]
        return {
            "cases run": len(ran), "cases failed to run": len(self.errors),
            "options not swept": len(self.not_swept),
            "option sets not reached (budget or time limit)": self.not_reached,
            "cases not reached of option sets run elsewhere (budget or time limit)":
                sum(len(lays) for lays in self.unreached.values()),
            "cases left to --full (the default plan's selection leaves them out)":
                sum(self.left_to_full.values()),
            "option sets with cases left to --full": len(self.left_to_full),
            "layouts a component does not support": len(self.not_applicable) - len(self.refused),
            "configurations megatron-core refuses": len(self.refused),
            "cases pruned (options the component's default run never read there)":
                sum(len(lays) for lays in self.pruned.values()),
            "findings": len(self.findings),
            "findings megatron.training refuses": sum(1 for f in self.findings
                                                      if (f.training_args or "").startswith(REFUSES)),
            "wall time (s)": round(self.seconds, 1),
            "stopped at the budget or time limit": self.stopped_early,
            "not_swept": self.not_swept,
            "not_reached": [f"{c} {dict(options) or 'defaults'}: not reached under {', '.join(lays)}"
                            for (c, options), lays in sorted(self.unreached.items(), key=repr)],
            "not_applicable": self.not_applicable,  # the refused ones too
            "refused": self.refused,
            "not_read": [f"{c}: {len(sets)} option set(s) never read: {'; '.join(sets)}"
                         for c, sets in self.not_read.items()],
            "cannot run on this version": self.unavailable,
            "cpu patches": self.patches,
            "errors": sorted({f"{o.case.label}: {o.error}" for o in self.errors}),
            "coverage": self.coverage(),
        }

    def coverage(self) -> dict[str, dict[str, Any]]:
        """Per component: the layouts it ran under (plain, explicit groups), the option sets
        run and left out, the options pruned as never read, the cases, and (type-checked) the
        share of megatron-core's op calls that got a type, per layout."""
        table: dict[str, dict[str, Any]] = {}
        components = sorted({o.case.component for o in self.outcomes} | {c for c, _ in self.left_out}
                            | set(self.not_read))
        for component in components:
            ran = [o for o in self.outcomes if o.case.component == component]
            layouts = sorted({o.case.layout for o in ran if not o.error},
                             key=lambda lay: (lay.world_size, str(lay)))
            table[component] = {
                "plain_layouts": [str(lay) for lay in layouts if not lay.explicit_groups],
                "explicit_layouts": [str(lay) for lay in layouts if lay.explicit_groups],
                "option_sets_run": len({o.case.options for o in ran}),
                "option_sets_left_out": sum(1 for c, _ in self.left_out if c == component),
                "options_not_read": len(self.not_read.get(component, [])),
                "cases_pruned": sum(len(lays) for (c, _), lays in self.pruned.items() if c == component),
                "cases_left_to_full": sum(n for (c, _), n in self.left_to_full.items() if c == component),
                "cases": len(ran)}
            ops = _megatron_ops(ran)
            if ops:
                table[component]["megatron_ops"] = ops
        return table


def _megatron_ops(outcomes: list[Outcome]) -> dict[str, Any]:
    """The op calls megatron-core made in these cases: in all, and per layout."""
    counted = [o for o in outcomes if o.ops]
    if not counted:
        return {}
    layouts = sorted({o.case.layout for o in counted}, key=lambda lay: (lay.world_size, str(lay)))
    by_layout = {str(lay): typed_share(op_counts(o.ops for o in counted if o.case.layout == lay))
                 for lay in layouts}
    return {**typed_share(op_counts(o.ops for o in counted), top=0), "by_layout": by_layout}


def typed_share(counts: dict, top: int = 10) -> dict[str, Any]:
    """Counts as the report shows them: the typed share, the most frequent unknown sites, and
    the origins that explain the unknown calls (:func:`unknown_origins`)."""
    total = counts["typed"] + counts["unknown"]
    worst = sorted(counts["unknown_at"].items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return {"typed": counts["typed"], "calls": total,
            "typed_share": round(counts["typed"] / total, 4) if total else 1.0,
            "unknown_at": [f"{location} ({n})" for location, n in worst],
            "unknown_from": unknown_origins(counts.get("unknown_from", {}), counts["unknown"])
            if top else []}


def unknown_origins(by_origin: dict[str, int], unknown: int, explained: float = 0.9,
                    most: int = 5) -> list[dict[str, Any]]:
    """The few origins (``file:line op: cause``) whose unknowns made most of the ``unknown``
    op calls, most first, until they explain ``explained`` of them (``most`` at most): each
    with its place, its cause in words, the calls it reached and their share."""
    found: list[dict[str, Any]] = []
    for origin, n in sorted(by_origin.items(), key=lambda kv: (-kv[1], kv[0]))[:most]:
        if sum(o["calls"] for o in found) >= explained * unknown:
            break
        place, _, cause = origin.partition(": ")
        found.append({"origin": place, "cause": cause, "calls": n,
                      "share": round(n / unknown, 4) if unknown else 0.0})
    return found


def audit_result(findings: list[Finding], outcomes: list[Outcome], not_swept: dict[tuple, str],
            not_applicable: Iterable[str], pruned: dict[tuple, list[str]], seconds: float,
            stopped_early: bool, patches: dict[str, str],
            left_to_full: dict[tuple, int] | None = None, one_rank: list[Outcome] | None = None,
            unreached: dict[tuple, list[str]] | None = None) -> AuditResult:
    """The result of the outcomes and findings, with the options left out listed by why and
    the cases the default plan left to --full counted per option set."""
    unavailable = {component: why for (component, options), why in not_swept.items()
                   if not options and why.startswith(FAILS)}
    return AuditResult(findings, outcomes, _listed(not_swept), seconds, stopped_early,
                       sorted(not_applicable), patches, unavailable, dict(not_swept),
                       _never_read(outcomes, not_swept, pruned), dict(pruned), dict(left_to_full or {}),
                       list(one_rank or []), dict(unreached or {}))


def _never_read(outcomes: list[Outcome], not_swept: dict[tuple, str],
                pruned: dict[tuple, list[str]]) -> dict[str, list[str]]:
    """Per component, the option sets pruned under every layout they came up under."""
    ran = {(o.case.component, o.case.options) for o in outcomes}
    found: dict[str, list[str]] = {}
    for component, options in sorted(pruned, key=repr):
        if (component, options) not in ran and (component, options) not in not_swept:
            found.setdefault(component, []).append(", ".join(f"{k}={v}" for k, v in options))
    return found


def _listed(not_swept: dict[tuple, str]) -> list[str]:
    return [f"{component} {dict(options) or 'defaults'}: {why}"
            for (component, options), why in sorted(not_swept.items(), key=repr)]
