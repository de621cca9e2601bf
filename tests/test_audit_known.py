"""What the default audit finds, release by release: each known finding again, by its minimal trigger.

The full default audit takes 12 minutes; its findings are kept here as their triggers (the
audit's `reproduce:` commands), each rerun alone, and each must give exactly its finding: the
same id (a hash of location, contract and the trigger's option names), kind and location. A finding a release no longer
has is listed with no finding: the release fixed it (or moved it, which the test then shows).
"""

import pytest

core = pytest.importorskip("megatron.core")

from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD, Runner  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow
for module in PRELOAD:
    __import__(module)

# release: trigger (component, options, layout) -> (id, kind, location), or None: no finding
GDN_OUT_NORM = "megatron/core/ssm/gated_delta_net/common.py:256"  # 0.19's `self.out_norm = build_module(`
KNOWN = {
    "0.16": {  # the default audits of docs/audit.md, by trigger
        # the checker too: out_norm's gradient unreduced over tp (its parameter R, its gradient P),
        # located where GatedDeltaNet builds out_norm (the HybridModel's is the same finding)
        ("gdn", (), "tp2"): ("0417853b55", "type+numeric", "megatron/core/ssm/gated_delta_net.py:202"),
        # numeric-only, narrowed to its first op (test below): the aux loss scaled by the local
        # token count, the line 0.19 fixed (it multiplies by the tp x cp group's size too); it
        # showed at the router's forward, router.py:639
        ("moe_router", (("calculate_per_token_loss", True),), "cp2"):
            ("389982c4ca", "numeric-only", "megatron/core/transformer/moe/router.py:466"),
        # located where the embedding's weight is built without its tensor_model_parallel mark
        # (the norm that miscounts it, optimizer/clip_grads.py, is where it shows)
        ("gpt", (("perform_initialization", False),), "tp2"):
            ("cfad8d3aaa", "type+numeric", "megatron/core/tensor_parallel/layers.py:239"),
        ("gpt", (("loss_mask", True),), "cp2"):
            ("df616ebeaf", "type+numeric", "megatron/core/pipeline_parallel/schedules.py:218"),
        # the call that passes no group, not the cross-entropy that falls back to the global one
        ("gpt", (), "tp2-cp2-sp@cp-tp"):
            ("0383c50af9", "type+numeric", "megatron/core/models/common/language_module/language_module.py:167"),
        ("output_loss", (("label_smoothing", 0.1),), "tp2"):
            ("37b07376ca", "type+numeric", "megatron/core/tensor_parallel/cross_entropy.py:219"),
        ("moe_router", (("padding", True),), "cp2"):
            ("bdad62606d", "type+numeric", "megatron/core/transformer/moe/moe_utils.py:214"),
        # checker false alarms, gone: the first stage now takes the broadcast count's type from
        # the last stage, and the softmax sink expanded along the cp-sharded queries fits S
        ("gpt", (("calculate_per_token_loss", True),), "cp2-pp2"): None,
        ("gpt", (("softmax_type", "learnable"),), "cp2"): None,
        # CP's query, key and value gradients joined: the value's rank chunk beside shards fits
        ("gpt", (("qk_layernorm", True),), "cp2"): None,
        ("gpt", (("qk_l2_norm", True),), "cp2"): None,
        # a real bug below the norm's tolerance, seen in what it counts per tensor
        # (tests/test_megatron_softmax_offset.py)
        ("gpt", (("softmax_type", "learnable"),), "tp2"):
            ("d54e92268b", "type+numeric", "megatron/core/transformer/dot_product_attention.py:127"),
        # checker false alarms, gone: the MTP hidden states chunked into as many pieces as
        # tp ranks (a rank-chunk guess in a matmul), one key head repeated to the query heads
        ("gpt", (("mtp_num_layers", 1),), "tp2"): None,
        ("gpt", (("num_query_groups", 1),), "tp2"): None,
        # checker false alarms, gone: Mamba's cp all-to-alls cut each tp rank's heads into cp
        # pieces, tp outside cp (tests/test_checker_nested_all_to_all.py)
        ("mamba", (), "tp2-cp2"): None,
        ("mamba", (), "tp2-cp2-sp"): None,  # (GDN refuses cp on 0.16)
    },
    "0.19": {  # the same triggers on 0.19.2: three fixed in megatron-core, the others found again
        ("gdn", (), "tp2"): ("6eb63a0a54", "type+numeric", GDN_OUT_NORM),
        ("moe_router", (("calculate_per_token_loss", True),), "cp2"): None,
        ("gpt", (("perform_initialization", False),), "tp2"): None,
        ("gpt", (("loss_mask", True),), "cp2"):
            ("8072320559", "type+numeric", "megatron/core/pipeline_parallel/schedules.py:290"),
        ("gpt", (), "tp2-cp2-sp@cp-tp"): None,  # GPTModel passes its tp group to the cross-entropy
        ("output_loss", (("label_smoothing", 0.1),), "tp2"):
            ("ad842d120d", "type+numeric", "megatron/core/tensor_parallel/cross_entropy.py:213"),
        ("moe_router", (("padding", True),), "cp2"):
            ("f995319d1f", "type+numeric", "megatron/core/transformer/moe/moe_utils.py:262"),
        ("gpt", (("calculate_per_token_loss", True),), "cp2-pp2"): None,  # checker false alarms,
        ("gpt", (("softmax_type", "learnable"),), "cp2"): None,  # gone as on 0.16
        ("gpt", (("qk_layernorm", True),), "cp2"): None,
        ("gpt", (("qk_l2_norm", True),), "cp2"): None,
        ("gpt", (("softmax_type", "learnable"),), "tp2"):
            ("d54e92268b", "type+numeric", "megatron/core/transformer/dot_product_attention.py:127"),
        ("gpt", (("mtp_num_layers", 1),), "tp2"): None,  # checker false alarms, gone as on 0.16,
        ("gpt", (("num_query_groups", 1),), "tp2"): None,
        ("gpt", (("mlp_chunks_for_training", 2),), "tp2"): None,  # and the MLP run in chunks
        ("gpt", (("mlp_chunks_for_training", 2),), "tp2-sp"): None,  # pieces of a shard rejoined
        ("multimodal", (("LLaVAModel.pixel_shuffle", True),), "tp2-sp"): None,  # no SP padding
        ("mamba", (), "tp2-cp2"): None,  # tp outside cp, as on 0.16
        ("mamba", (), "tp2-cp2-sp"): None,
        ("gdn", (), "tp2-cp2-sp"): None,  # GDN's sections too, permuted for one all-to-all
        # the real out_norm gradient bug, confirmed by parity and typed (the checker's contract
        # of the nesting gap gone from it)
        ("gdn", (), "tp2-cp2"): ("6eb63a0a54", "type+numeric", GDN_OUT_NORM),
        # checker false alarm, gone: the alltoall dispatcher's rows routed to the experts' ranks
        ("moe", (("moe_token_dispatcher_type", "alltoall"),), "dp2-ep2"): None,
        ("moe", (("moe_token_dispatcher_type", "alltoall"),), "cp2-ep2"): None,
        # checker false alarm, gone: FP4 pads each expert's routed rows with zero rows
        ("moe", (("fp4", "e2m1"),), "dp2-ep2"): None,
    },
}
RELEASE = ".".join(core.__version__.split(".")[:2])
PER_TOKEN_AUX_LOSS = ("moe_router", (("calculate_per_token_loss", True),), "cp2")


@pytest.mark.parametrize("trigger", list(KNOWN.get(RELEASE, {})), ids=str)
def test_each_known_finding_is_found_again_by_its_trigger(audit_pools, trigger):
    component, options, layout = trigger
    result = audit([Case(component, options, Layout.parse(layout))], run_pools=audit_pools)
    assert not result.errors and not result.not_swept, (result.errors, result.not_swept)
    expected = KNOWN[RELEASE][trigger]
    assert [(f.id, f.kind, f.location) for f in result.findings] == ([expected] if expected else [])


@pytest.mark.release_specific
def test_a_numeric_only_divergence_is_narrowed_to_its_first_op_and_its_fix_to_none(audit_pools):
    """0.16 scales the per-token aux loss by the local token count alone: the finding is located
    at that product, the first op whose values part ways, and shows where it showed (the
    router's forward). 0.19 scales it by the tp x cp size too (the fix): no op parts ways there
    (the first product alone differs, the line's result agrees)."""
    component, options, layout = PER_TOKEN_AUX_LOSS
    case = Case(component, options, Layout.parse(layout))
    if RELEASE == "0.19":
        assert Runner(audit_pools, typecheck=True).first_op(case) is None
        return
    [finding] = audit([case], run_pools=audit_pools).findings
    assert finding.first_op == ("first op: megatron/core/transformer/moe/router.py:466 in "
                                "attach_and_log_load_balancing_loss: aten.mul.Tensor (max abs error 8.01)")
    assert (finding.location, finding.showed) == ("megatron/core/transformer/moe/router.py:466",
                                                  "megatron/core/transformer/moe/router.py:639")
