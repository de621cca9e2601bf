"""shardcheck: find silent numerical-correctness bugs in distributed PyTorch training."""

from shardcheck.types import Axis, I, Mesh, P, Placement, R, S, Shard, V

__version__ = "0.1.0"

__all__ = ["I", "P", "R", "S", "V", "Axis", "Mesh", "Placement", "Shard", "__version__"]

from shardcheck.layout import Layout, LayoutError  # noqa: E402
from shardcheck.scenario import ScenarioContext, current_context, replicate, shard  # noqa: E402

__all__ += ["Layout", "LayoutError", "ScenarioContext", "current_context", "replicate", "shard"]

from shardcheck.checker import (  # noqa: E402
    Coverage,
    SpmdTypeError,
    annotate,
    assert_type,
    contract,
    coverage,
    rank_slice,
    register_rule,
    typecheck,
    typeof,
    violations,
)

__all__ += [
    "Coverage", "SpmdTypeError", "annotate", "assert_type", "contract", "coverage",
    "rank_slice", "register_rule", "typecheck", "typeof", "violations",
]
from shardcheck.parity import ParityResult, parity  # noqa: E402
from shardcheck.pool import PoolFailure, RankPool  # noqa: E402

__all__ += ["ParityResult", "PoolFailure", "RankPool", "parity"]
