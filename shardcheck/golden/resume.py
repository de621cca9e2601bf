"""Checkpoint-resume tests: where the run resumed, and Megatron's first-vs-second-run check."""

from __future__ import annotations

from collections.abc import Sequence

from shardcheck.golden.config import ModelConfig
from shardcheck.golden.io import GoldenFile
from shardcheck.golden.verdict import Verdict, ci_verdict

RESUME_TEST_TYPES = ("ckpt-resume", "frozen-resume")


def resume_step_from_config(config: ModelConfig) -> int | None:
    """The step a resume test restarts after: the save interval, else half of --train-iters."""
    if config.test_type not in RESUME_TEST_TYPES:
        return None
    save_interval = config.arg_int("--save-interval")
    if save_interval:
        return save_interval
    train_iters = config.arg_int("--train-iters")
    return train_iters // 2 if train_iters else None


def after_step(golden: GoldenFile, step: int) -> GoldenFile:
    """The same file restricted to the steps after ``step``."""
    metrics = {name: series.after(step) for name, series in golden.metrics.items()}
    return GoldenFile(f"{golden.source} [steps > {step}]", metrics, golden.legacy, golden.notes)


def resume_verdict(
    first_run: GoldenFile,
    second_run: GoldenFile,
    resume_step: int,
    metrics: Sequence[str],
    allow_nondeterministic: bool = False,
) -> Verdict:
    """Megatron's resume check: the second run's steps after K against the first run's."""
    return ci_verdict(
        after_step(first_run, resume_step),
        after_step(second_run, resume_step),
        metrics,
        allow_nondeterministic,
    )
