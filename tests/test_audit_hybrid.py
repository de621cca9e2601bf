"""The audit's ``hybrid`` component: Megatron's ``HybridModel`` (Mamba, Gated DeltaNet, attention,
MLP or MoE layers and an MTP depth) on Transformer Engine, swept like the GPT.

megatron-core 0.19.2 deprecates ``GPTModel`` for it; 0.16.1 has none (the catalogue leaves the
component out there). On 0.19.2 it agrees with one rank under tp2-sp (its MoE pattern too),
and under tp2 (without sequence parallelism) gives #7452's GDN output-norm finding through
the model: the same finding as the GDN layer's alone, at the line that builds out_norm.
"""

import typing

import pytest

pytest.importorskip("megatron.core.models.hybrid")

from test_audit_te import needs_te  # noqa: E402

from shardcheck.megatron.audit.outcome import CONFIG_REFUSES, Outcome  # noqa: E402
from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.schedule import Swept, record  # noqa: E402
from shardcheck.megatron.audit.sweep import (  # noqa: E402
    Case,
    component_options,
    components_plan,
    impl_of,
    layouts,
    model_class,
    passed_by_scenario,
)
from shardcheck.megatron.cpu.parallel import LayoutUnsupported  # noqa: E402
from shardcheck.megatron.scenarios import COMPONENTS  # noqa: E402
from shardcheck.megatron.scenarios.gpt import transformer_config  # noqa: E402
from shardcheck.megatron.scenarios.hybrid import HybridSetup, Pattern, check_setup, stack_spec  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

MOE = (("pattern", "MG*E/M*"),)


def test_hybrid_is_a_component_of_its_own_that_runs_on_transformer_engine_under_explicit_groups():
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    entry = COMPONENTS["hybrid"]
    assert entry.explicit_groups and model_class("hybrid") is HybridModel
    # every case of its plan goes to the TE host, with no impl option of its own
    planned = [case for case in components_plan(["hybrid"], layouts(explicit=True)) if case.component == "hybrid"]
    assert planned and all(impl_of(case.options, case.component) == "te" for case in planned)
    assert not any(name == "impl" for case in planned for name, _ in case.options)
    assert any(case.layout.explicit_groups for case in planned)
    assert (impl_of((), "gpt"), impl_of((), "output_loss"), impl_of((("impl", "te"),), "gpt")) == ("local", "local", "te")


def test_its_patterns_mix_every_cpu_layer_kind_with_one_mtp_depth():
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern

    patterns = typing.get_args(Pattern)
    assert patterns[0] == HybridSetup().pattern
    for pattern in patterns:
        parsed = parse_hybrid_pattern(pattern)
        assert len(parsed.main_pattern) == HybridSetup().layers
        assert parsed.mtp_num_depths == HybridSetup.base_config["mtp_num_layers"] == 1
    assert set("".join(patterns)) - {"/"} == {"M", "G", "*", "-", "E"}
    config = transformer_config(Layout(tp=2), HybridSetup())
    assert (config.mtp_num_layers, config.num_layers, config.normalization) == (1, 4, "RMSNorm")


def test_it_sweeps_its_patterns_its_own_config_fields_and_the_hybrid_models_arguments():
    options = component_options("hybrid")
    assert MOE[0] in options and ("HybridModel.parallel_output", False) in options
    assert ("HybridModel.forward.runtime_gather_output", True) in options
    config_names = {name for name, _ in options if name.startswith(("mamba_", "linear_"))}
    assert config_names and not config_names & set(HybridSetup.base_config)  # its sizes are its own
    assert not any(name.startswith("moe_") for name, _ in options)  # the moe component's
    assert {"hybrid_layer_pattern", "hybrid_stack_spec", "position_embedding_type"} <= passed_by_scenario(
        "hybrid", "__init__")


def test_it_refuses_local_layers_fp32_context_parallelism_and_moe_under_tp_without_sp():
    with pytest.raises(ValueError, match="Transformer Engine only"):
        check_setup(Layout(tp=2), HybridSetup(impl="local"))
    with pytest.raises(LayoutUnsupported, match="no fp32 attention under context parallelism"):
        check_setup(Layout(cp=2), HybridSetup())
    check_setup(Layout(cp=2), HybridSetup(config={"bf16": True}))
    check_setup(Layout(tp=2, sp=True), HybridSetup(pattern="MG*E/M*"))
    with pytest.raises(LayoutUnsupported) as refused:
        check_setup(Layout(tp=2), HybridSetup(pattern="MG*E/M*"))
    # the audit closes that pattern under tp2, not the layout: the default pattern runs there
    swept = Swept()
    record(swept, Outcome(Case("hybrid", MOE, Layout(tp=2)), error=f"{LayoutUnsupported.__name__}: {refused.value}"))
    assert list(swept.not_applicable) == [("hybrid", "tp2", MOE)]
    assert str(refused.value).startswith(CONFIG_REFUSES)


def test_the_stack_spec_keeps_grouped_gemm_experts_only_when_asked():
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    assert stack_spec(grouped_gemm=True) is hybrid_stack_spec
    local = stack_spec()
    assert local.submodules.moe_layer.submodules.mlp != hybrid_stack_spec.submodules.moe_layer.submodules.mlp
    assert local.submodules.mamba_layer is hybrid_stack_spec.submodules.mamba_layer


@needs_te
def test_the_hybrid_model_agrees_with_one_rank_and_finds_the_gdn_out_norm_under_tp2(audit_pools):
    """The GDN layer's out_norm gradient, reached through the model and through the layer alone,
    is one finding, located where GatedDeltaNet builds out_norm (the model's gradients are
    checked there, as the layer's are)."""
    cases = [Case("hybrid", (), Layout.parse(name)) for name in ("tp2-sp", "tp2")]
    cases += [Case("hybrid", MOE, Layout.parse("tp2-sp")), Case("gdn", (), Layout.parse("tp2"))]
    result = audit(cases, run_pools=audit_pools)
    assert not result.errors and len(result.outcomes) == len(cases)
    assert [(o.case.component, str(o.case.layout)) for o in result.outcomes if o.failed] == [
        ("hybrid", "tp2"), ("gdn", "tp2")]
    [finding] = result.findings
    assert finding.trigger == {"component": "gdn", "options": {}, "layout": "tp2"}
    assert finding.location.startswith("megatron/core/ssm/gated_delta_net/common.py:"), finding.location
    assert finding.checker.startswith(f"checker: unreduced gradient at {finding.location} in check_gradients")
    assert finding.seen_in == ["layouts: tp2", "components: gdn, and through hybrid"]
    assert {"component": "hybrid", "layout": "tp2", "options": {}} in finding.cases
    [hybrid] = [o for o in result.outcomes if o.failed and o.case.component == "hybrid"]
    [gap] = [g for g in hybrid.gaps if g.name.startswith("grad/")]
    assert gap.name.endswith("self_attention.out_norm.weight")  # the G layer's
    # checked where built, not again at the optimizer step
    assert [v["location"] for v in hybrid.violations if v["rule"] == "unreduced gradient"] == [finding.location]
