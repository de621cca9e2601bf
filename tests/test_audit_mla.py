"""The audit's ``mla`` component: a GPT with megatron-core's multi-latent attention on Transformer
Engine's layer spec, unfused (``MLASelfAttention``) and fused (``FusedMLASelfAttention``).

megatron-core's local spec does not build MLA (its ``DotProductAttention`` takes no
``k_channels``), so the component runs on TE only. On 0.19.2 it agrees with one rank under
tp2-sp; under tp2 without sequence parallelism, and fused under any tp, the gradient of the
rotary key (``k_pos_emb``, split off the down projection's output in
``get_query_key_value_tensors``) is a partial sum over tp that no collective reduces, a real
bug: the same runs with ``copy_to_tensor_model_parallel_region`` on ``k_pos_emb`` agree with
one rank (docs/audit.md, "Multi-latent attention").
"""

import inspect

import pytest
import torch
from test_audit_te import needs_te

from shardcheck.megatron.audit.run import audit
from shardcheck.megatron.audit.runner import Runner
from shardcheck.megatron.audit.schedule import in_default_plan
from shardcheck.megatron.audit.sweep import Case, component_options, config_class, impl_of
from shardcheck.megatron.checks import piece_gradients
from shardcheck.megatron.checks.shards import _covers, _rows_of
from shardcheck.megatron.cpu.parallel import LayoutUnsupported
from shardcheck.megatron.scenarios import COMPONENTS, MLA_DEFAULT_LAYOUTS
from shardcheck.megatron.scenarios.gpt import transformer_config
from shardcheck.megatron.scenarios.mla import (
    LOCAL_SPEC_FAILS,
    NO_CP_ATTENTION,
    Q_LORA_RANK,
    MLASetup,
    check_layout,
    check_setup,
)
from shardcheck.parity.layout import Layout

pytest.importorskip("megatron.core")
FUSED = (("mla_down_proj_fusion", True),)


def test_mla_is_a_component_on_transformer_engine_with_mla_configs():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    entry = COMPONENTS["mla"]
    assert entry.explicit_groups and config_class("mla") is MLATransformerConfig
    assert impl_of((), "mla") == "te" and config_class("gpt").__name__ == "TransformerConfig"
    config = transformer_config(Layout(tp=2), MLASetup())
    assert isinstance(config, MLATransformerConfig) and config.multi_latent_attention
    assert (config.q_lora_rank, config.tensor_model_parallel_size) == (Q_LORA_RANK, 2)
    assert transformer_config(Layout(), MLASetup(compressed_query=False)).q_lora_rank is None


def test_megatron_cores_local_spec_cannot_build_mla_so_local_layers_are_refused():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    assert "k_channels=" in inspect.getsource(MultiLatentAttention.__init__)
    assert "k_channels" not in inspect.signature(DotProductAttention.__init__).parameters
    with pytest.raises(ValueError, match="Transformer Engine only"):
        check_setup(MLASetup(impl="local"))
    assert "DotProductAttention" in LOCAL_SPEC_FAILS
    with pytest.raises(ValueError, match="no MLATransformerConfig"):
        check_setup(MLASetup(heterogeneous=True))
    check_setup(MLASetup())


def test_context_parallelism_is_not_applicable():
    with pytest.raises(LayoutUnsupported, match="no attention backend for MLA under context parallelism"):
        check_layout(Layout(cp=2))
    assert COMPONENTS["mla"].refuses(Layout(tp=2, cp=2, sp=True)) == NO_CP_ATTENTION
    assert COMPONENTS["mla"].refuses(Layout(tp=2, dp=2)) is None


def test_it_sweeps_its_query_compression_and_the_mla_fields_its_code_reads():
    options = dict(component_options("mla"))
    assert options["compressed_query"] is False
    assert "cache_mla_latents" in options  # an MLATransformerConfig field MLA's code reads
    assert "multi_latent_attention" not in options  # the component's own switch stays on
    assert not {"kv_lora_rank", "qk_head_dim", "v_head_dim"} & set(options)  # its sizes
    assert "moe_router_topk" not in options and not any(name.startswith("GPTModel") for name in options)
    if hasattr(config_class("mla"), "mla_down_proj_fusion"):  # megatron-core 0.19 on
        assert options["mla_down_proj_fusion"] is True


def test_its_default_plan_is_a_slice_and_the_rest_is_left_to_full():
    for name in ("tp2", "tp2-sp"):
        assert in_default_plan(Case("mla", (), Layout.parse(name)))
    assert MLA_DEFAULT_LAYOUTS == ("tp2", "tp2-sp")
    assert not in_default_plan(Case("mla", (), Layout.parse("dp2")))
    assert not in_default_plan(Case("mla", (("compressed_query", False),), Layout.parse("tp2")))
    assert not in_default_plan(Case("mla", (), Layout.parse("tp2-dp2@dp-tp")))
    # the gpt component keeps the whole default selection
    assert in_default_plan(Case("gpt", (), Layout.parse("dp2")))
    if hasattr(config_class("mla"), "mla_down_proj_fusion"):
        assert in_default_plan(Case("mla", FUSED, Layout.parse("tp2-sp")))
        assert not in_default_plan(Case("mla", FUSED, Layout.parse("tp2")))


def test_a_parameter_held_as_row_blocks_is_found_by_its_blocks():
    weight = torch.nn.Parameter(torch.zeros(6, 4))
    other = torch.nn.Parameter(torch.zeros(6, 4))
    named = [("other", other), ("fused", weight)]
    q, kv = torch.split(weight, [2, 4], dim=0)
    assert (_rows_of(named, q), _rows_of(named, kv)) == (("fused", 0), ("fused", 2))
    assert _rows_of(named, weight[:, :2]) is None  # columns are not row blocks
    assert _covers([(2, 4, None), (0, 2, None)], 6)
    assert not _covers([(0, 2, None)], 6) and not _covers([(0, 2, None), (3, 3, None)], 6)


@needs_te
@pytest.mark.skipif(not hasattr(config_class("mla"), "mla_down_proj_fusion"), reason="no fused MLA")
def test_mla_agrees_with_one_rank_under_sp_and_its_rotary_key_gradient_is_partial_elsewhere(audit_pools):
    """Unfused under tp2-sp: clean. Unfused under tp2 and fused under tp2-sp: the rotary key's
    gradient is a partial sum over tp, so the key-value down projection's weight (the fused
    one's key-value rows, under their checkpoint key) differs; the query's does not."""
    cases = [Case("mla", (), Layout.parse("tp2-sp")), Case("mla", (), Layout.parse("tp2")),
             Case("mla", FUSED, Layout.parse("tp2-sp"))]
    result = audit(cases, run_pools=audit_pools)
    assert not result.errors and len(result.outcomes) == 3
    clean, *partial = result.outcomes
    assert not clean.failed and all(outcome.failed for outcome in partial)
    for outcome in partial:
        names = {gap.name for gap in outcome.gaps}
        assert "grad/decoder.layers.self_attention.linear_kv_down_proj.weight" in names
        assert "grad/decoder.layers.self_attention.linear_q_down_proj.weight" not in names
    # the checker's violation is raised in the split's backward (a C++ node): the finding is
    # located at the forward line of that split, where the gradient was left partial
    assert {f.location.rsplit(":", 1)[0] for f in result.findings} == {"megatron/core/transformer/multi_latent_attention.py"}
    assert all(f.showed and f.checker and "multi_latent_attention.py" in f.checker for f in result.findings)
    # the corrected control all-reduces over tp the gradient of the split's piece 1 (k_pos_emb)
    # at that line, and agrees with one rank; the same all-reduce on piece 0 does not
    for finding in result.findings:
        assert finding.control["equal_to_reference"], finding.control
        assert f"piece 1 of the split at {finding.location}" in finding.control["fix"]
    site = next(f.location for f in result.findings if f.trigger["layout"] == "tp2")
    wrong = Runner(audit_pools, typecheck=False).run(cases[1], fixes=(f"{piece_gradients.PREFIX}tp:0:{site}",))
    assert "grad/decoder.layers.self_attention.linear_kv_down_proj.weight" in {gap.name for gap in wrong.gaps}


def test_a_partial_piece_gradient_at_a_split_gets_the_all_reduce_of_that_piece_as_its_fix():
    site = "megatron/core/transformer/multi_latent_attention.py:749"
    violation = {"rule": "affine on partial", "op": "aten.cat.default", "backward": "SplitWithSizesBackward0",
                 "axis": "tp", "partial": [1], "location": site}
    name, note = piece_gradients.fix_for(violation)
    assert piece_gradients.parse(name) == ("tp", (1,), site)
    assert f"all-reduce over tp the gradient of piece 1 of the split at {site}" in note
    for other in ({"backward": ""}, {"backward": "CatBackward0"}, {"partial": []}, {"op": "aten.add.Tensor"}):
        assert piece_gradients.fix_for({**violation, **other}) is None, other  # no split's partial piece
    assert piece_gradients.fix_for(None) is None
