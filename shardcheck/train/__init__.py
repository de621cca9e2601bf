"""Compare a training run on N ranks with its one-rank run, step by step (no Megatron here)."""

from shardcheck.train.golden_form import golden_document, write_golden, write_model_config
from shardcheck.train.records import RecordError, Run, Step, load_run, merge_ranks
from shardcheck.train.verdict import Tolerance, TrainVerdict, compare_runs

__all__ = ["RecordError", "Run", "Step", "Tolerance", "TrainVerdict", "compare_runs", "golden_document",
           "load_run", "merge_ranks", "write_golden", "write_model_config"]
