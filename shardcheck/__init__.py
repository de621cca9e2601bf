"""shardcheck: find silent numerical-correctness bugs in distributed PyTorch training."""

from shardcheck import backward_rules, norm_tracking  # noqa: F401  (they register their rules)
from shardcheck.checker import (
    Coverage,
    SpmdTypeError,
    annotate,
    assert_type,
    confirmed_across_ranks,
    contract,
    coverage,
    rank_slice,
    register_rule,
    typecheck,
    typeof,
    violations,
)
from shardcheck.gradients import annotate_parameters, check_gradients
from shardcheck.layout import Layout, LayoutError
from shardcheck.parity import ParityResult, parity
from shardcheck.pool import PoolFailure, RankPool
from shardcheck.scenario import ScenarioContext, current_context, replicate, shard
from shardcheck.types import Axis, I, Mesh, P, Placement, R, S, Shard, V

__version__ = "0.1.0"

__all__ = [
    "I", "P", "R", "S", "V", "Axis", "Mesh", "Placement", "Shard", "__version__",
    "Layout", "LayoutError", "ScenarioContext", "current_context", "replicate", "shard",
    "Coverage", "SpmdTypeError", "annotate", "assert_type", "confirmed_across_ranks", "contract", "coverage",
    "rank_slice", "register_rule", "typecheck", "typeof", "violations",
    "ParityResult", "PoolFailure", "RankPool", "parity",
    "annotate_parameters", "check_gradients",
]
