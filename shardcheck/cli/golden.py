"""``shardcheck golden``: Megatron's CI verdict, honest comparisons, noise tests, explanations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console

from shardcheck.cli.errors import input_errors
from shardcheck.golden import report
from shardcheck.golden.compare import FileComparison, compare_git, compare_paths
from shardcheck.golden.config import DEFAULT_METRICS, ModelConfig, load_model_config
from shardcheck.golden.explain import explain_num_zeros
from shardcheck.golden.io import GoldenFile, GoldenInputError, load_expert_tokens, load_golden
from shardcheck.golden.noise import noise_verdict
from shardcheck.golden.resume import resume_step_from_config, resume_verdict
from shardcheck.golden.verdict import ci_verdict

EXIT_FAIL = 1


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 180, highlight=False)


_clean_errors = input_errors(GoldenInputError)  # one ``Error:`` line on stderr, exit status 2


@click.group()
def golden() -> None:
    """Triage Megatron-LM golden-value regressions (training-metric JSON files)."""


def _config(path: str | None) -> ModelConfig | None:
    return load_model_config(path) if path else None


def _ci_input(path: str) -> GoldenFile:
    loaded = load_golden(path)
    if loaded.legacy:
        raise GoldenInputError(
            f"{path}: legacy format (list values); Megatron's CI cannot read it, "
            "use `shardcheck golden compare` for such files"
        )
    return loaded


@golden.command()
@click.argument("golden_path", metavar="GOLDEN")
@click.argument("actual_path", metavar="ACTUAL")
@click.option("--model-config", "config_path", help="model_config.yaml: METRICS, nondeterminism.")
@click.option("--metric", "metrics", multiple=True, help="Check this metric (repeatable).")
@click.option(
    "--allow-nondeterministic",
    is_flag=True,
    help="Approximate checks only, as the CI's --allow-nondeterministic-algo.",
)
@click.option("--second-run", help="Resume test: the second (resumed) run's values.")
@click.option("--resume-step", type=int, help="Resume test: the step the second run resumed after.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@_clean_errors
def check(
    golden_path,
    actual_path,
    config_path,
    metrics,
    allow_nondeterministic,
    second_run,
    resume_step,
    as_json,
) -> None:
    """The verdict Megatron's CI gives ACTUAL against GOLDEN; exit 1 on FAIL."""
    config = _config(config_path)
    chosen = tuple(metrics) or (config.metrics() if config else DEFAULT_METRICS)
    from_config = bool(config and config.allows_nondeterministic())
    lenient = allow_nondeterministic or from_config
    actual = _ci_input(actual_path)
    verdicts = {"golden values": ci_verdict(_ci_input(golden_path), actual, chosen, lenient)}
    if second_run:
        step = resume_step or (resume_step_from_config(config) if config else None)
        if step is None:
            raise GoldenInputError(
                "--second-run needs --resume-step or a ckpt-resume --model-config"
            )
        title = f"resume: second run vs first run after step {step}"
        verdicts[title] = resume_verdict(actual, _ci_input(second_run), step, chosen, lenient)
    if as_json:
        click.echo(json.dumps({k: report.verdict_json(v) for k, v in verdicts.items()}, indent=2))
    else:
        mode = "exact and approximate checks"
        if lenient:
            source = "the config's ENV_VARS" if from_config else "--allow-nondeterministic"
            mode = f"approximate checks only (nondeterminism allowed by {source})"
        _print_verdicts(verdicts, f"metrics: {', '.join(chosen)}; {mode}")
    if not all(v.passed for v in verdicts.values()):
        sys.exit(EXIT_FAIL)


def _print_verdicts(verdicts: dict, heading: str) -> None:
    console = _console()
    console.print(heading)
    for title, verdict in verdicts.items():
        report.print_verdict(console, verdict, title)


@golden.command()
@click.argument("paths", nargs=-1, metavar="[OLD NEW]")
@click.option("--repo", type=click.Path(file_okay=False), help="Git repository for --rev.")
@click.option("--rev", "revs", multiple=True, help="Old then new git revision (give twice).")
@click.option("--file", "git_file", help="With --repo: only this golden file path.")
@click.option("--old-repeats", multiple=True, help="Another run of the old side (repeatable).")
@click.option("--new-repeats", multiple=True, help="Another run of the new side (repeatable).")
@click.option("--resume-step", type=int, help="Also compare steps up to and after this step.")
@click.option(
    "--model-config", "config_path", help="model_config.yaml (resume step of ckpt-resume tests)."
)
@click.option("--metric", "metrics", multiple=True, help="Only this metric (repeatable).")
@click.option("--markdown", is_flag=True, help="Print Markdown instead of tables.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--html", "html_path", help="Also write a self-contained HTML report here.")
@_clean_errors
def compare(
    paths,
    repo,
    revs,
    git_file,
    old_repeats,
    new_repeats,
    resume_step,
    config_path,
    metrics,
    markdown,
    as_json,
    html_path,
) -> None:
    """Compare OLD and NEW golden values: files, directories, or --repo with two --rev."""
    config = _config(config_path)
    step = resume_step or (resume_step_from_config(config) if config else None)
    comparisons = _filtered(_comparisons(paths, repo, revs, git_file, step), metrics)
    noise = _noise(paths, old_repeats, new_repeats, comparisons)
    many = len(comparisons) > (3 if step else 1)
    if as_json:
        payload = {
            "files": report.comparisons_json(comparisons),
            "noise": [report.noise_json(v) for v in noise],
        }
        click.echo(json.dumps(payload, indent=2))
    elif markdown:
        click.echo(report.comparisons_markdown(comparisons, summary=many))
    else:
        _print_compare(comparisons, noise, many)
    if html_path:
        from shardcheck.golden.html import write_html

        write_html(Path(html_path), comparisons, noise)
        click.echo(f"wrote {html_path}", err=True)


def _comparisons(paths, repo, revs, git_file, step) -> list[FileComparison]:
    if repo or revs:
        if paths or not repo or len(revs) != 2:
            raise GoldenInputError(
                "git mode takes --repo DIR and exactly two --rev, and no OLD NEW"
            )
        return compare_git(Path(repo), revs[0], revs[1], git_file, step)
    if len(paths) != 2:
        raise GoldenInputError("give OLD and NEW (files or directories), or --repo with two --rev")
    return compare_paths(Path(paths[0]), Path(paths[1]), step)


def _filtered(comparisons: list[FileComparison], metrics) -> list[FileComparison]:
    if not metrics:
        return comparisons
    wanted = set(metrics)
    known = {m.metric for fc in comparisons for m in fc.metrics}
    unknown = sorted(wanted - known)
    if unknown:
        raise GoldenInputError(
            f"no metric {', '.join(map(repr, unknown))} in the compared files; "
            f"they have: {', '.join(sorted(known)) or 'none'}"
        )
    return [
        FileComparison(
            fc.label,
            tuple(m for m in fc.metrics if m.metric in wanted),
            fc.notes,
            fc.skipped,
            fc.old,
            fc.new,
        )
        for fc in comparisons
    ]


def _noise(paths, old_repeats, new_repeats, comparisons: list[FileComparison]) -> list:
    if not old_repeats and not new_repeats:
        return []
    if len(paths) != 2 or Path(paths[0]).is_dir():
        raise GoldenInputError("--old-repeats/--new-repeats need OLD and NEW to be files")
    old_runs = [load_golden(p) for p in (paths[0], *old_repeats)]
    new_runs = [load_golden(p) for p in (paths[1], *new_repeats)]
    metrics = [m.metric for m in comparisons[0].metrics]
    return [v for m in metrics if (v := noise_verdict(old_runs, new_runs, m)) is not None]


def _print_compare(comparisons: list[FileComparison], noise: list, many: bool) -> None:
    console = _console()
    if many:
        report.print_summary(console, comparisons)
    else:
        report.print_comparisons(console, comparisons)
    if noise:
        report.print_noise(console, noise)


@golden.command()
@click.argument("old_path", metavar="OLD")
@click.argument("new_path", metavar="NEW")
@click.option(
    "--model-config", "config_path", required=True, help="model_config.yaml with the model's sizes."
)
@click.option("--metric", default="num-zeros", show_default=True, help="The zero-count metric.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@_clean_errors
def explain(old_path, new_path, config_path, metric, as_json) -> None:
    """Attribute num-zeros jumps between OLD and NEW to whole parameter blocks."""
    config = load_model_config(config_path)
    old, new = load_golden(old_path), load_golden(new_path)
    for name, loaded in (("OLD", old), ("NEW", new)):
        if metric not in loaded.metrics:
            raise GoldenInputError(f"{name} {loaded.source}: no {metric!r} metric")
    explanation = explain_num_zeros(old.metrics[metric], new.metrics[metric], config,
                                    load_expert_tokens(old_path), load_expert_tokens(new_path))
    if as_json:
        click.echo(json.dumps(report.explanation_json(explanation), indent=2))
        return
    for line in report.explanation_lines(explanation):
        click.echo(line)
