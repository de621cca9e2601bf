"""The MoE GPT on real megatron-core: correct under SP and expert parallelism, and typed so.

The router's aux-loss gradient (an expanded replicated row) meets the S(0) router scores in
their softmax / sigmoid backward, and the aux-loss tracker adds each layer's P loss into a
zero tensor indexed by layer: none of it is a finding.
"""

import pytest

pytest.importorskip("megatron.core")

from shardcheck.layout import Layout  # noqa: E402
from shardcheck.megatron.audit import PRELOAD, audit, pools  # noqa: E402
from shardcheck.megatron.sweep import Case  # noqa: E402

pytestmark = pytest.mark.slow
for module in PRELOAD:
    __import__(module)

CASES = [
    Case("moe", (), Layout.parse("tp2-sp")),
    Case("moe", (("moe_router_score_function", "sigmoid"),), Layout.parse("tp2-sp")),
    Case("moe", (), Layout.parse("tp2-dp2-ep2-sp")),
]


def test_moe_gpt_under_sp_and_expert_parallelism_gives_no_finding():
    with pools() as warm:
        result = audit(CASES, run_pools=warm)
    assert not result.errors, [o.error for o in result.errors]
    assert len(result.outcomes) == len(CASES)
    assert [(f.kind, f.checker) for f in result.findings] == []
