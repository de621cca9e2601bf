"""The GPT's ``heterogeneous`` option: a Llama-Nemotron-style model from megatron-core's
heterogeneous block spec (layers whose attention or MLP is full, left out, or one linear layer).

megatron-core 0.19.2's linear replacement (``heterogeneous/linear_replacements.py``) gathers its
output on parallel_state's global tensor-parallel group, not the model's: under explicit groups in
another rank order the audit finds it, located where the call leaves the group out, and the
corrected control repairs it. Data and pipeline parallelism stay clean.
"""

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core.transformer.heterogeneous.heterogeneous_config")

from shardcheck.fuzz.repro import ReproError  # noqa: E402
from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.sweep import Case, components_plan, layouts  # noqa: E402
from shardcheck.megatron.cpu.parallel import LayoutUnsupported  # noqa: E402
from shardcheck.megatron.repro.templates import script_body  # noqa: E402
from shardcheck.megatron.scenarios import heterogeneous  # noqa: E402
from shardcheck.megatron.scenarios.gpt import GPTSetup, MoEGPTSetup, transformer_config  # noqa: E402
from shardcheck.megatron.scenarios.hybrid import HybridSetup, check_setup  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

HETEROGENEOUS = (("heterogeneous", True),)


def test_the_option_builds_megatrons_heterogeneous_config_with_one_layer_per_block():
    config = transformer_config(Layout(), GPTSetup(heterogeneous=True))
    assert type(config) is heterogeneous.config_type()
    assert config.num_layers == len(heterogeneous.BLOCKS) == len(config.per_block_parameters)
    kinds = [("none" if b.attention.no_op else "linear" if b.attention.replace_with_linear else "full",
              "none" if b.mlp.no_op else "linear" if b.mlp.replace_with_linear else "full")
             for b in config.per_block_parameters]
    assert kinds == [("full", "full"), ("none", "full"), ("linear", "linear"), ("full", "none")]
    assert json.loads(config.heterogeneous_layers_config_encoded_json)["block_configs"] == heterogeneous.BLOCKS
    assert type(transformer_config(Layout(), GPTSetup())).__name__ == "TransformerConfig"


def test_it_is_swept_for_the_gpt_and_refused_where_megatron_builds_no_heterogeneous_layers():
    planned = {case.options for case in components_plan(["gpt"], layouts(explicit=True))}
    assert HETEROGENEOUS in planned
    with pytest.raises(LayoutUnsupported, match="builds neither experts nor MTP layers"):
        heterogeneous.layer_specs(transformer_config(Layout(), MoEGPTSetup(heterogeneous=True)), False)
    with pytest.raises(LayoutUnsupported, match="HybridModel takes its layers from its pattern"):
        check_setup(Layout(), HybridSetup(heterogeneous=True))


@pytest.mark.slow
@pytest.mark.release_specific
def test_the_linear_replacements_gather_on_the_global_tp_group_is_found_and_correct_layouts_stay_clean(audit_pools):
    cases = [Case("gpt", HETEROGENEOUS, Layout.parse(name)) for name in ("tp2-dp2@dp-tp", "dp2", "pp2")]
    result = audit(cases, run_pools=audit_pools)
    assert not result.errors and len(result.outcomes) == len(cases)
    assert [str(o.case.layout) for o in result.outcomes if o.failed] == ["tp2-dp2@dp-tp"]
    [finding] = result.findings
    assert finding.kind == "type+numeric"
    assert finding.location.startswith("megatron/core/transformer/heterogeneous/linear_replacements.py:")
    assert "_gather_from_tensor_parallel_region makes the call without it" in finding.title
    assert finding.control is not None and finding.control["equal_to_reference"], finding.control
    with pytest.raises(ReproError, match="^no script for a heterogeneous GPT yet"):
        script_body(finding)


@pytest.mark.release_specific
def test_the_linear_replacements_pad_of_the_wrong_dim_under_sequence_parallelism_is_located_at_the_pad(audit_pools):
    """megatron-core's ColumnParallelLinearGathered under tp2-sp pads its output's sequence dim
    where it means the hidden one (``F.pad``'s first pair is the last dim), and the layer's
    residual add fails: the crash is located at the pad, where it showed at the add."""
    [finding] = audit([Case("gpt", HETEROGENEOUS, Layout.parse("tp2-sp"))], run_pools=audit_pools).findings
    assert finding.kind == "crash" and "must match the size of tensor b" in finding.title
    path, line = finding.location.rsplit(":", 1)
    assert path == "megatron/core/transformer/heterogeneous/linear_replacements.py"
    import megatron.core

    source = (Path(megatron.core.__file__).parents[2] / path).read_text().splitlines()
    assert "F.pad(" in source[int(line) - 1], source[int(line) - 1]
    assert finding.showed.startswith("megatron/core/fusions/fused_bias_dropout.py:")
