"""Golden-value triage for Megatron-LM functional tests: CI verdict, statistics, noise, explanations."""

from shardcheck.golden.compare import FileComparison, compare_git, compare_golden, compare_paths
from shardcheck.golden.config import ModelConfig, load_model_config
from shardcheck.golden.explain import Explanation, candidate_blocks, explain_num_zeros
from shardcheck.golden.io import GoldenFile, GoldenInputError, MetricSeries, load_golden
from shardcheck.golden.noise import NoiseVerdict, noise_verdict, recommended_tolerance
from shardcheck.golden.resume import resume_step_from_config, resume_verdict
from shardcheck.golden.stats import MetricComparison, compare_metric
from shardcheck.golden.verdict import Verdict, allowed_failing_steps, blind_spots, ci_verdict

__all__ = [
    "Explanation",
    "FileComparison",
    "GoldenFile",
    "GoldenInputError",
    "MetricComparison",
    "MetricSeries",
    "ModelConfig",
    "NoiseVerdict",
    "Verdict",
    "allowed_failing_steps",
    "blind_spots",
    "candidate_blocks",
    "ci_verdict",
    "compare_git",
    "compare_golden",
    "compare_metric",
    "compare_paths",
    "explain_num_zeros",
    "load_golden",
    "load_model_config",
    "noise_verdict",
    "recommended_tolerance",
    "resume_step_from_config",
    "resume_verdict",
]
