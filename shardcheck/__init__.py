"""shardcheck: find silent numerical-correctness bugs in distributed PyTorch training."""

from shardcheck.parity.compare import ParityResult, parity
from shardcheck.parity.layout import Layout, LayoutError
from shardcheck.parity.pool import PoolFailure, RankPool
from shardcheck.parity.scenario import ScenarioContext, current_context, replicate, shard
from shardcheck.typecheck.checker import (
    Coverage,
    annotate,
    assert_type,
    confirmed_across_ranks,
    contract,
    coverage,
    rank_slice,
    typecheck,
    typeof,
    violations,
)
from shardcheck.typecheck.gradients import annotate_parameters, check_gradients
from shardcheck.typecheck.rules.registry import register_rule
from shardcheck.typecheck.types import Axis, I, Mesh, P, Placement, R, S, Shard, V
from shardcheck.typecheck.violations import SpmdTypeError

__version__ = "0.1.0"

__all__ = [
    "I", "P", "R", "S", "V", "Axis", "Mesh", "Placement", "Shard", "__version__",
    "Layout", "LayoutError", "ScenarioContext", "current_context", "replicate", "shard",
    "Coverage", "SpmdTypeError", "annotate", "assert_type", "confirmed_across_ranks", "contract", "coverage",
    "rank_slice", "register_rule", "typecheck", "typeof", "violations",
    "ParityResult", "PoolFailure", "RankPool", "parity",
    "annotate_parameters", "check_gradients",
]
