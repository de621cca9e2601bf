"""The MoE GPT on real megatron-core: correct under SP and expert parallelism, and typed so.

The router's aux-loss gradient (an expanded replicated row) meets the S(0) router scores in
their softmax / sigmoid backward, and the aux-loss tracker adds each layer's P loss into a
zero tensor indexed by layer: none of it is a finding. The alltoall dispatcher (0.19) permutes
each rank's own tokens by its own routing map (an argsort: V) and adds them back in place
after the experts: its output is the sequence shard it was given.
"""


import pytest

pytest.importorskip("megatron.core")

from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow
for module in PRELOAD:
    __import__(module)

CASES = [
    Case("moe", (), Layout.parse("tp2-sp")),
    Case("moe", (("moe_router_score_function", "sigmoid"),), Layout.parse("tp2-sp")),
    Case("moe", (), Layout.parse("tp2-dp2-ep2-sp")),
    Case("moe", (("moe_token_dispatcher_type", "alltoall"),), Layout.parse("tp2-sp")),
    # ep over the cp ranks: a cut by the one rank index of both (the CP attention backward's
    # chunks, the dispatcher's local experts) is the rank's chunk on each
    Case("moe", (("moe_token_dispatcher_type", "alltoall"),), Layout.parse("cp2-dp2-ep2")),
    Case("moe", (), Layout.parse("cp2-dp2-ep2")),
]


def test_moe_gpt_under_sp_and_expert_parallelism_gives_no_finding(audit_pools):
    result = audit(CASES, run_pools=audit_pools)
    assert not result.errors, [o.error for o in result.errors]
    assert len(result.outcomes) == len(CASES)
    assert [(f.kind, f.checker) for f in result.findings] == []


def test_alltoall_token_counts_and_rows_gathered_over_tp_and_ep_give_no_finding(audit_pools):
    """The alltoall dispatcher gathers every rank's partial token counts over tp x ep, and the
    rows routed to a rank over tp with its split sizes (pieces the checker leaves unknown)."""
    case = Case("moe", (("moe_token_dispatcher_type", "alltoall"),), Layout.parse("tp2-dp2-ep2-sp"))
    result = audit([case], run_pools=audit_pools)
    assert not result.errors, [o.error for o in result.errors]
    assert [o.case for o in result.outcomes] == [case]  # it ran: no finding is not "nothing ran"
    assert [(f.kind, f.checker) for f in result.findings] == []


def test_device_limited_routing_is_compared_only_where_one_rank_computes_the_same(audit_pools):
    """``moe_router_topk_limited_devices`` limits each token to experts on k of the ep ranks:
    on one rank (ep=1) that is no limit, so its case is not applicable; the same routing
    spelled as expert groups (two groups, one taken) means the same on one rank and agrees."""
    from test_audit_options import GROUPED, LIMITED

    layout = Layout.parse("dp2-ep2")
    result = audit([Case("moe", LIMITED, layout), Case("moe", GROUPED, layout)], run_pools=audit_pools)
    assert not result.errors, [o.error for o in result.errors]
    assert [o.case.options for o in result.outcomes] == [GROUPED]
    assert [f.kind for f in result.findings] == []
    (why,) = [line for line in result.not_applicable if "moe_router_topk_limited_devices" in line]
    assert "moe_router_num_groups=2 here but 1 on one rank" in why


def test_at_dp2_ep2_the_dense_gradients_all_reduced_over_dp_are_reduced_over_ep_too(audit_pools):
    """Megatron's dp and ep groups are the same ranks there; the experts' own gradients come
    through the dispatcher's all_to_all as routed rows (S(0) per local expert)."""
    case = Case("moe", (("moe_token_dispatcher_type", "alltoall"),), Layout.parse("dp2-ep2"))
    result = audit([case], run_pools=audit_pools)
    [outcome] = result.outcomes
    assert not outcome.gaps and not outcome.error
    assert [v["line"] for v in outcome.violations] == []
