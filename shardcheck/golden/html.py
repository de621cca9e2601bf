"""A self-contained HTML report: tables plus matplotlib plots embedded as base64 PNGs."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from shardcheck.golden.compare import FileComparison  # noqa: E402
from shardcheck.golden.io import GoldenInputError  # noqa: E402
from shardcheck.golden.noise import NoiseVerdict  # noqa: E402
from shardcheck.golden.report import (  # noqa: E402
    COMPARE_COLUMNS,
    NOISE_COLUMNS,
    metric_notes,
    metric_row,
    noise_row,
    summary_counts,
)
from shardcheck.golden.stats import MetricComparison, paired_steps  # noqa: E402

MAX_PLOTTED_FILES = 20
STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1200px}"
    "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
    "text-align:right}td:first-child,th:first-child{text-align:left}img{max-width:100%}"
    ".note{color:#444}.warn{color:#a33}"
)


def metric_figure_png(fc: FileComparison, m: MetricComparison, noise: NoiseVerdict | None) -> str:
    """A two-panel plot (values per step; per-step ratio on a log scale) as a base64 PNG."""
    pair = paired_steps(fc.old.metrics[m.metric], fc.new.metrics[m.metric])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    _values_panel(top, fc, m.metric, noise)
    _ratio_panel(bottom, pair.steps, pair.new / pair.old)
    for axis in (top, bottom):
        for i, change in enumerate(m.largest[:5]):
            label = "largest changes" if i == 0 and axis is top else None
            axis.axvline(change.step, color="tab:red", alpha=0.25, linewidth=3, label=label)
    top.legend(loc="best", fontsize=8)
    top.set_title(f"{fc.label}: {m.metric} ({m.pattern})", fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _values_panel(axis, fc: FileComparison, metric: str, noise: NoiseVerdict | None) -> None:
    for side, golden, colour in (("old", fc.old, "tab:blue"), ("new", fc.new, "tab:orange")):
        steps, values = golden.metrics[metric].finite()
        axis.plot(steps, values, marker=".", markersize=3, linewidth=1, color=colour, label=side)
    if noise is not None:
        for band, colour in ((noise.old_band, "tab:blue"), (noise.new_band, "tab:orange")):
            axis.fill_between(band.steps, band.low, band.high, color=colour, alpha=0.2)
    values = np.concatenate([g.metrics[metric].finite()[1] for g in (fc.old, fc.new)])
    positive = values[values > 0]
    if len(positive) and positive.max() / positive.min() > 100:
        axis.set_yscale("log")
    axis.set_ylabel(metric)


def _ratio_panel(axis, steps: np.ndarray, ratio: np.ndarray) -> None:
    shown = ratio > 0
    axis.plot(steps[shown], ratio[shown], marker=".", markersize=3, linewidth=1, color="tab:green")
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_yscale("log")
    axis.set_ylabel("new / old (log)")
    axis.set_xlabel("step")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _changed(fc: FileComparison) -> bool:
    return any(m.changed for m in fc.metrics)


def _file_section(fc: FileComparison, noise: dict[str, NoiseVerdict], plot: bool) -> str:
    title = f"<h2>{html.escape(fc.label)}</h2>"
    if fc.skipped:
        return title + f"<p class=warn>skipped: {html.escape(fc.skipped)}</p>"
    parts = [title, _table(COMPARE_COLUMNS, [metric_row(m) for m in fc.metrics])]
    notes = [*fc.notes, *(n for m in fc.metrics for n in metric_notes(m))]
    parts += [f"<p class=note>{html.escape(n)}</p>" for n in notes]
    if plot and fc.old is not None:
        for m in fc.metrics:
            if m.steps and m.changed:
                png = metric_figure_png(fc, m, noise.get(m.metric))
                parts.append(
                    f'<img alt="{html.escape(m.metric)}" src="data:image/png;base64,{png}">'
                )
    return "\n".join(parts)


def write_html(
    path: Path, comparisons: Sequence[FileComparison], noise: Sequence[NoiseVerdict] = ()
) -> None:
    """Write the report: changed (or skipped) pairs, with plots for the first MAX_PLOTTED_FILES."""
    by_metric = {v.metric: v for v in noise}
    shown = [fc for fc in comparisons if len(comparisons) == 1 or fc.skipped or _changed(fc)]
    plotted = {id(fc) for fc in [fc for fc in shown if not fc.skipped][:MAX_PLOTTED_FILES]}
    sections = [f"<p>{html.escape(summary_counts(comparisons))}</p>"]
    sections += [_file_section(fc, by_metric, id(fc) in plotted) for fc in shown]
    if noise:
        sections.append(
            "<h2>run-to-run noise</h2>" + _table(NOISE_COLUMNS, [noise_row(v) for v in noise])
        )
    page = (
        "<!doctype html><html><head><meta charset=utf-8><title>shardcheck golden compare</title>"
        f"<style>{STYLE}</style></head><body><h1>shardcheck golden compare</h1>"
        + "\n".join(sections)
        + "</body></html>"
    )
    try:
        path.write_text(page)
    except OSError as err:
        raise GoldenInputError(f"cannot write {path}: {err.strerror}") from None
