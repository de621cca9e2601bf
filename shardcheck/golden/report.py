"""Render golden triage results as rich tables, Markdown or JSON."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardcheck.golden.compare import FileComparison
from shardcheck.golden.explain import ONE_EXPERT, Explanation, IdleExperts
from shardcheck.golden.noise import Band, NoiseVerdict
from shardcheck.golden.stats import MetricComparison, StepChange, format_value
from shardcheck.golden.verdict import CheckResult, Verdict

COMPARE_COLUMNS = (
    "metric",
    "steps",
    "Megatron mean((old-new)/old)",
    "ratio of means",
    "median ratio",
    "geo-mean ratio",
    ">1%",
    ">5%",
    ">20%",
    "pattern",
)


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:+.1%}"


def _ratio(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.4f}"


def metric_row(m: MetricComparison) -> list[str]:
    """One comparison row as strings, in COMPARE_COLUMNS order."""
    shares = [
        f"{m.share_changed[level]:.0%}" if m.share_changed else "n/a"
        for level in (0.01, 0.05, 0.20)
    ]
    flag = " (!)" if m.disagreement else ""
    return [
        m.metric,
        str(m.steps),
        _pct(m.megatron_signed_mean) + flag,
        _ratio(m.ratio_of_means),
        _ratio(m.median_ratio),
        _ratio(m.geomean_ratio),
        *shares,
        m.pattern,
    ]


def largest_text(m: MetricComparison, top: int = 3) -> str:
    """The largest per-step changes, e.g. 'step 58: 50,777 -> 1,050,746 (x20.69)'."""
    return "; ".join(
        f"step {c.step}: {format_value(c.old)} -> {format_value(c.new)} (x{c.ratio:.4g})"
        for c in m.largest[:top]
    )


def metric_notes(m: MetricComparison) -> list[str]:
    """Free-text lines under a comparison table: disagreement and largest changes."""
    lines = []
    if m.disagreement:
        lines.append(f"{m.metric}: (!) {m.disagreement}")
    if m.changed and m.largest:
        lines.append(f"{m.metric}: largest changes: {largest_text(m)}")
    return lines


def print_comparisons(console: Console, comparisons: Sequence[FileComparison]) -> None:
    """A table per file pair, with notes below it."""
    for fc in comparisons:
        if fc.skipped:
            console.print(f"[yellow]{escape(fc.label)}: skipped: {escape(fc.skipped)}[/]")
            continue
        table = Table(title=escape(fc.label), title_justify="left")
        for column in COMPARE_COLUMNS:
            table.add_column(column, justify="left" if column in ("metric", "pattern") else "right")
        for m in fc.metrics:
            table.add_row(*map(escape, metric_row(m)))
        console.print(table)
        for line in [*fc.notes, *(n for m in fc.metrics for n in metric_notes(m))]:
            console.print(f"  {escape(line)}", soft_wrap=True)


def summary_rows(comparisons: Sequence[FileComparison]) -> list[list[str]]:
    """One row per changed metric of each file, for directory and git comparisons."""
    rows = []
    for fc in comparisons:
        for m in fc.metrics:
            if m.changed:
                rows.append([fc.label, *metric_row(m)])
    return rows


def summary_counts(comparisons: Sequence[FileComparison]) -> str:
    """'N pairs compared, K skipped; M metrics changed, D with a misleading signed mean'."""
    compared = [fc for fc in comparisons if not fc.skipped]
    metrics = [m for fc in compared for m in fc.metrics]
    changed = [m for m in metrics if m.changed]
    misleading = [m for m in metrics if m.disagreement]
    return (
        f"{len(compared)} file pair(s) compared, {len(comparisons) - len(compared)} skipped; "
        f"{len(changed)} of {len(metrics)} metric series changed, "
        f"{len(misleading)} with a misleading signed mean"
    )


def print_summary(console: Console, comparisons: Sequence[FileComparison]) -> None:
    """The summary table for many file pairs: changed metrics only, then the skipped files."""
    table = Table(title="changed metrics", title_justify="left")
    table.add_column("file", overflow="fold")
    for column in COMPARE_COLUMNS:
        table.add_column(column)
    for row in summary_rows(comparisons):
        table.add_row(*map(escape, row))
    console.print(table)
    for reason, labels in skip_reasons(comparisons).items():
        shown = ", ".join(labels[:3]) + (
            f", ... ({len(labels) - 3} more)" if len(labels) > 3 else ""
        )
        console.print(f"  skipped {len(labels)}: {escape(reason)}: {escape(shown)}", soft_wrap=True)
    console.print(summary_counts(comparisons))


def skip_reasons(comparisons: Sequence[FileComparison]) -> dict[str, list[str]]:
    """Skipped file pairs grouped by reason (the reason without its leading file name)."""
    groups: dict[str, list[str]] = {}
    for fc in comparisons:
        if fc.skipped:
            groups.setdefault(re.sub(r"^\S+\.json: ", "", fc.skipped), []).append(fc.label)
    return groups


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def comparisons_markdown(comparisons: Sequence[FileComparison], summary: bool) -> str:
    """Markdown for file comparisons (a summary table when ``summary``)."""
    if summary:
        parts = [
            summary_counts(comparisons),
            markdown_table(("file", *COMPARE_COLUMNS), summary_rows(comparisons)),
        ]
        groups = skip_reasons(comparisons)
        if groups:
            parts.append("\n".join(f"- skipped {len(v)}: {reason}" for reason, v in groups.items()))
        return "\n\n".join(parts) + "\n"
    parts = []
    for fc in comparisons:
        if fc.skipped:
            parts.append(f"**{fc.label}**: skipped: {fc.skipped}")
            continue
        notes = [*fc.notes, *(n for m in fc.metrics for n in metric_notes(m))]
        parts.append(
            f"### {fc.label}\n\n"
            + markdown_table(COMPARE_COLUMNS, [metric_row(m) for m in fc.metrics])
        )
        if notes:
            parts.append("\n".join(f"- {n}" for n in notes))
    return "\n\n".join(parts) + "\n"


def metric_json(m: MetricComparison) -> dict:
    """A comparison as plain JSON values (NaN becomes null)."""
    return {
        "metric": m.metric,
        "steps": m.steps,
        "skipped_zero_old": m.skipped_zero_old,
        "megatron_signed_mean": _finite(m.megatron_signed_mean),
        "old_mean": _finite(m.old_mean),
        "new_mean": _finite(m.new_mean),
        "ratio_of_means": _finite(m.ratio_of_means),
        "median_ratio": _finite(m.median_ratio),
        "geomean_ratio": _finite(m.geomean_ratio),
        "share_changed": {f"{level:.2f}": v for level, v in m.share_changed.items()},
        "changed_steps": {
            f"{level:.2f}": [_step_json(c) for c in steps]
            for level, steps in m.changed_steps.items()
        },
        "largest": [_step_json(c) for c in m.largest],
        "pattern": m.pattern,
        "disagreement": m.disagreement or None,
    }


def _step_json(c: StepChange) -> dict:
    return {"step": c.step, "old": c.old, "new": c.new}


def comparisons_json(comparisons: Sequence[FileComparison]) -> list[dict]:
    """All file comparisons as JSON values."""
    return [
        {
            "file": fc.label,
            "skipped": fc.skipped or None,
            "notes": list(fc.notes),
            "metrics": [metric_json(m) for m in fc.metrics],
        }
        for fc in comparisons
    ]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


NOISE_COLUMNS = (
    "metric",
    "runs old/new",
    "steps",
    "median shift",
    "permutation p",
    "old band width",
    "new mean outside old band",
    "verdict",
    "Megatron rtol old/new",
)


def noise_row(v: NoiseVerdict) -> list[str]:
    """One row of the repeats table."""
    verdict = {
        None: f"too few runs (smallest possible p {v.smallest_p:.2f})",
        True: "shift exceeds run-to-run noise",
        False: "within run-to-run noise",
    }[v.exceeds_noise]
    return [
        v.metric,
        f"{v.old_runs}/{v.new_runs}",
        str(v.steps),
        f"{math.expm1(v.median_log_ratio):+.2%}",
        f"{v.p_value:.3f}",
        f"{v.old_band.median_relative_width():.2%}",
        f"{v.outside_old_band:.0%}",
        verdict,
        f"{v.tolerance_old:.4f} / {v.tolerance_new:.4f}",
    ]


def print_noise(console: Console, verdicts: Sequence[NoiseVerdict]) -> None:
    """The repeats table."""
    table = Table(title="run-to-run noise (permutation test over run labels)", title_justify="left")
    for column in NOISE_COLUMNS:
        table.add_column(column)
    for v in verdicts:
        table.add_row(*map(escape, noise_row(v)))
    console.print(table)


def noise_json(v: NoiseVerdict) -> dict:
    """A noise verdict as JSON values."""
    return {
        "metric": v.metric,
        "old_runs": v.old_runs,
        "new_runs": v.new_runs,
        "steps": v.steps,
        "median_log_ratio": v.median_log_ratio,
        "p_value": v.p_value,
        "smallest_possible_p": v.smallest_p,
        "exceeds_noise": v.exceeds_noise,
        "outside_old_band": v.outside_old_band,
        "recommended_rtol_old": v.tolerance_old,
        "recommended_rtol_new": v.tolerance_new,
        "bands": {side: _band_json(b) for side, b in (("old", v.old_band), ("new", v.new_band))},
    }


def _band_json(band: Band) -> dict:
    return {
        "steps": band.steps.tolist(),
        "mean": band.mean.tolist(),
        "low": band.low.tolist(),
        "high": band.high.tolist(),
    }


def check_line(r: CheckResult) -> str:
    """'PASS lm loss deterministic: 100 steps' or FAIL with the failing steps."""
    status = "PASS" if r.passed else "FAIL"
    if r.kind == "setup":
        return f"{status} {r.metric}: {r.detail}"
    text = f"{status} {r.metric} {r.kind} (rtol {r.rtol:g}): "
    if r.detail:
        return text + r.detail
    text += f"{len(r.failing_steps)} of {r.steps_evaluated} step(s) off"
    if r.kind == "approximate" and r.steps_evaluated > 1:
        text += f", {r.allowed_failures} allowed"
    if r.unlogged_failures:
        text += f" ({r.unlogged_failures} not logged by the run)"
    if r.failing_steps:
        shown = ", ".join(str(s) for s in r.failing_steps[:12])
        more = f", ... ({len(r.failing_steps) - 12} more)" if len(r.failing_steps) > 12 else ""
        text += f"; failing steps: {shown}{more}"
    return text


def print_verdict(console: Console, verdict: Verdict, title: str) -> None:
    """PASS/FAIL per check, then the blind-spot warnings."""
    console.print(f"[bold]{escape(title)}[/]")
    for r in verdict.results:
        colour = "green" if r.passed else "red"
        console.print(f"  [{colour}]{escape(check_line(r))}[/]", soft_wrap=True)
    for w in verdict.warnings:
        console.print(f"  [yellow]warning: {escape(w)}[/]", soft_wrap=True)
    console.print(f"  => {'PASS' if verdict.passed else 'FAIL'}")


def verdict_json(verdict: Verdict) -> dict:
    """A verdict as JSON values."""
    return {
        "passed": verdict.passed,
        "checks": [
            {
                "metric": r.metric,
                "kind": r.kind,
                "passed": r.passed,
                "rtol": r.rtol,
                "steps_evaluated": r.steps_evaluated,
                "failing_steps": list(r.failing_steps),
                "allowed_failures": r.allowed_failures,
                "unlogged_failures": r.unlogged_failures,
                "detail": r.detail or None,
            }
            for r in verdict.results
        ],
        "warnings": list(verdict.warnings),
    }


def explanation_lines(e: Explanation) -> list[str]:
    """The explanation as plain lines."""
    lines = ["candidate blocks (values per block):"]
    lines += [f"  {b.name}: {b.formula} = {b.size:,}" for b in e.candidates]
    if e.block is None:
        lines.append(
            "no candidate block's whole multiples explain the counts; nothing to attribute"
        )
        return lines
    size = e.block.size
    lines.append(f"best fit: {e.block.name}, {size:,} values")
    holding = [s for s in e.steps if s.old_blocks or s.new_blocks]
    lines.append(f"steps holding whole blocks: {len(holding)} of {len(e.steps)} shared steps")
    for s in holding:
        old_r, new_r = s.residuals(size)
        delta = s.new_blocks - s.old_blocks
        change = "same" if delta == 0 else f"{delta:+d} block(s)"
        lines.append(
            f"  step {s.step}: old {s.old:,.0f} = {s.old_blocks} x {size:,} + {old_r:,.0f}; "
            f"new {s.new:,.0f} = {s.new_blocks} x {size:,} + {new_r:,.0f}  [{change}]"
        )
    gained = [f"{s.step} ({s.new_blocks - s.old_blocks:+d})" for s in e.changed()]
    lines.append(f"steps that gained or lost whole blocks: {', '.join(gained) or 'none'}")
    if gained:
        deltas = [s.new_blocks - s.old_blocks for s in e.changed()]
        up, down = [d for d in deltas if d > 0], [d for d in deltas if d < 0]
        lines.append(
            f"  in total: gained {sum(up)} block(s) at {len(up)} step(s), lost {-sum(down)} at "
            f"{len(down)} step(s), net {sum(deltas):+d} = {sum(deltas) * size:+,} values"
        )
    if e.poor_fit:
        lines.append(
            f"steps whose residual exceeds 10% of a block: {', '.join(map(str, e.poor_fit))}"
        )
    r = e.residual
    if r is not None:
        lines.append(
            f"residual baseline: mean {format_value(r.old_mean)} -> {format_value(r.new_mean)} "
            f"(ratio of means {_ratio(r.ratio_of_means)}, median ratio {_ratio(r.median_ratio)}, "
            f"{r.pattern})"
        )
    return lines + _idle_lines(e)


def _idle_lines(e: Explanation) -> list[str]:
    """Each step's experts without tokens, and whether they are its whole blocks."""
    if e.idle is None:
        return []
    lines = [f"experts that received no tokens (tokens per expert beside both files): "
             f"{len(e.idle)} step(s)"]
    lines += [f"  step {i.step}: old {_idle(i.old)}; new {_idle(i.new)}" for i in e.idle]
    if e.block is not None and e.block.name == ONE_EXPERT:
        off = e.unexplained_by_idle_experts()
        lines.append("whole blocks are the idle experts at every step" if not off else
                     "whole blocks differ from the idle experts at step(s) "
                     + ", ".join(f"{s.step} ({s.old_blocks}/{s.new_blocks} blocks)" for s in off))
    return lines


def _idle(side: dict[str, tuple[int, ...]]) -> str:
    if not side:
        return "none"
    return ", ".join(f"{router} {list(experts)}" for router, experts in side.items())


def explanation_json(e: Explanation) -> dict:
    """An explanation as JSON values."""
    size = e.block.size if e.block else 0
    return {
        "metric": e.metric,
        "candidates": [
            {"name": b.name, "size": b.size, "formula": b.formula} for b in e.candidates
        ],
        "block": None if e.block is None else {"name": e.block.name, "size": size},
        "steps": [
            {
                "step": s.step,
                "old": s.old,
                "new": s.new,
                "old_blocks": s.old_blocks,
                "new_blocks": s.new_blocks,
                "old_residual": s.residuals(size)[0],
                "new_residual": s.residuals(size)[1],
            }
            for s in e.steps
            if s.old_blocks or s.new_blocks
        ],
        "residual": None if e.residual is None else metric_json(e.residual),
        "poor_fit": list(e.poor_fit),
        "idle_experts": None if e.idle is None else [_idle_json(i) for i in e.idle],
    }


def _idle_json(i: IdleExperts) -> dict:
    return {"step": i.step, "old": {r: list(x) for r, x in i.old.items()},
            "new": {r: list(x) for r, x in i.new.items()}}
