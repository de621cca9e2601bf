"""Pair old and new golden-value files (two files, two trees, or two git revisions) and compare."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from shardcheck.golden.io import GoldenFile, GoldenInputError, load_golden, parse_golden
from shardcheck.golden.stats import MetricComparison, compare_metric

GOLDEN_GLOB = "golden_values*.json"


@dataclass(frozen=True)
class FileComparison:
    """The comparison of one old/new file pair; ``skipped`` says why there is none."""

    label: str
    metrics: tuple[MetricComparison, ...] = ()
    notes: tuple[str, ...] = field(default=())
    skipped: str = ""
    old: GoldenFile | None = field(default=None, repr=False)
    new: GoldenFile | None = field(default=None, repr=False)


def compare_golden(
    old: GoldenFile, new: GoldenFile, label: str, resume_step: int | None = None
) -> list[FileComparison]:
    """Compare every metric both files have; with ``resume_step``, also before and after it."""
    shared = [m for m in old.metrics if m in new.metrics]
    notes = [f"old: {n}" for n in old.notes] + [f"new: {n}" for n in new.notes]
    for side, mine, other in (("old", old, new), ("new", new, old)):
        only = [m for m in mine.metrics if m not in other.metrics]
        if only:
            notes.append(f"only in {side}: {', '.join(only)}")
    metrics = tuple(compare_metric(old.metrics[m], new.metrics[m]) for m in shared)
    whole = FileComparison(label, metrics, tuple(notes), old=old, new=new)
    if resume_step is None:
        return [whole]
    return [whole, *_phases(old, new, shared, label, resume_step)]


def _phases(
    old: GoldenFile, new: GoldenFile, shared: list[str], label: str, k: int
) -> list[FileComparison]:
    before = tuple(compare_metric(old.metrics[m].until(k), new.metrics[m].until(k)) for m in shared)
    after = tuple(compare_metric(old.metrics[m].after(k), new.metrics[m].after(k)) for m in shared)
    return [
        FileComparison(f"{label} [steps <= {k}]", before),
        FileComparison(f"{label} [steps > {k}]", after),
    ]


def compare_paths(old: Path, new: Path, resume_step: int | None = None) -> list[FileComparison]:
    """Two files, or two directories matched by relative path."""
    if old.is_dir() != new.is_dir():
        raise GoldenInputError(f"cannot compare a directory with a file: {old} vs {new}")
    if old.is_dir():
        return compare_trees(old, new, resume_step)
    label = old.name if old.name == new.name else f"{old.name} vs {new.name}"
    return compare_golden(load_golden(old), load_golden(new), label, resume_step)


def compare_trees(old: Path, new: Path, resume_step: int | None = None) -> list[FileComparison]:
    """Every golden_values*.json of two trees, matched by relative path."""
    old_files = {p.relative_to(old).as_posix() for p in old.rglob(GOLDEN_GLOB)}
    new_files = {p.relative_to(new).as_posix() for p in new.rglob(GOLDEN_GLOB)}
    if not old_files and not new_files:
        raise GoldenInputError(f"no {GOLDEN_GLOB} files under {old} or {new}")
    results: list[FileComparison] = []
    for rel in sorted(old_files | new_files):
        if rel not in new_files or rel not in old_files:
            side = "old" if rel in old_files else "new"
            results.append(FileComparison(rel, skipped=f"only in {side}"))
            continue
        results += _compare_or_skip(
            lambda r=rel: (load_golden(old / r), load_golden(new / r)), rel, resume_step
        )
    return results


def compare_git(
    repo: Path, rev_old: str, rev_new: str, file: str | None = None, resume_step: int | None = None
) -> list[FileComparison]:
    """Golden files changed between two revisions of a git repository (or just ``file``)."""
    for rev in (rev_old, rev_new):
        _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    paths = [file] if file else _changed_golden_files(repo, rev_old, rev_new)
    results: list[FileComparison] = []
    for rel in paths:
        results += _compare_or_skip(
            lambda r=rel: (_git_golden(repo, rev_old, r), _git_golden(repo, rev_new, r)),
            rel,
            resume_step,
        )
    return results


def _compare_or_skip(load_pair, label: str, resume_step: int | None) -> list[FileComparison]:
    try:
        old, new = load_pair()
    except GoldenInputError as err:
        return [FileComparison(label, skipped=str(err))]
    return compare_golden(old, new, label, resume_step)


def _changed_golden_files(repo: Path, rev_old: str, rev_new: str) -> list[str]:
    out = _git(repo, "diff", "--name-only", "--diff-filter=M", rev_old, rev_new)
    return [line for line in out.splitlines() if Path(line).match(GOLDEN_GLOB)]


def _git_golden(repo: Path, rev: str, rel: str) -> GoldenFile:
    return parse_golden(_git(repo, "show", f"{rev}:{rel}"), f"{rev}:{rel}")


def _git(repo: Path, *args: str) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise GoldenInputError(f"git {args[0]} failed: {err}") from None
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no such revision or path"])[0]
        raise GoldenInputError(f"git {' '.join(args)}: {reason}")
    return done.stdout
