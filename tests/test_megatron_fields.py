"""The config space is read from Megatron's dataclasses, and probing a value tells what it needs."""

import pytest

pytest.importorskip("megatron.core")

import megatron.core.pipeline_parallel.schedules  # noqa: E402, F401  (imported once, before forking)

from shardcheck.megatron.audit.fields import classify, config_choices, known_blocker, probe  # noqa: E402
from shardcheck.parity.launch import spawn_ranks  # noqa: E402


def test_choices_cover_booleans_literals_and_enums_of_both_dataclasses():
    choices = {c.name: c for c in config_choices()}
    assert choices["sequence_parallel"].owner == "ModelParallelConfig"
    assert choices["gated_linear_unit"].values == (False, True)
    assert choices["normalization"].values == ("LayerNorm", "RMSNorm")
    assert set(choices["moe_token_dispatcher_type"].values) == {"allgather", "alltoall", "flex"}
    assert None in choices["recompute_granularity"].values
    assert "attention_backend" in choices  # an Enum
    assert "hidden_size" not in choices and "activation_func" not in choices
    assert len(choices) > 100


def test_known_blockers_name_gpu_only_families():
    assert "Transformer Engine" in known_blocker("fp8_recipe")
    assert known_blocker("gradient_accumulation_fusion")
    assert known_blocker("gated_linear_unit") is None


def test_classify_tells_gpu_needs_from_invalid_combinations():
    assert classify(None) == "runs"
    assert classify(AssertionError("Torch not compiled with CUDA enabled")) == "needs-gpu"
    assert classify(ValueError("apply_rope_fusion is not available. Please install TE >= 1.4.")) == "needs-gpu"
    assert classify(ValueError("Cannot use sequence parallelism without tensor parallelism")) == "invalid"


def _probe_three():
    return [probe("gated_linear_unit", True), probe("gradient_accumulation_fusion", True),
            probe("sequence_parallel", True)]


@pytest.mark.slow
def test_probe_runs_the_real_model():
    ran, fused, sp_alone = spawn_ranks(_probe_three, 1, timeout=600)[0]
    assert ran == ("runs", "")
    assert fused[0] == "needs-gpu" and "fused_weight_gradient_mlp_cuda" in fused[1]
    assert sp_alone[0] == "invalid"


def test_every_preset_builds_a_scenario_and_unknown_names_are_refused():
    from shardcheck.megatron.scenarios import PRESETS, preset, scenario

    assert all(callable(preset(name)) for name in PRESETS)
    with pytest.raises(KeyError, match="unknown Megatron component"):
        scenario("bert")
    with pytest.raises(TypeError):
        scenario("gpt", no_such_option=1)


def _run_every_preset():
    from shardcheck.megatron.cpu.runner import RankContext
    from shardcheck.megatron.scenarios import PRESETS, preset
    from shardcheck.parity.layout import Layout

    return {name: sorted(preset(name)(RankContext(Layout(), 0))) for name in PRESETS}


@pytest.mark.slow
def test_every_preset_runs_on_one_rank():
    outputs = spawn_ranks(_run_every_preset, 1, timeout=600)[0]
    assert all("loss" in names or "probs" in names for names in outputs.values())
    assert any(n.startswith("grad/decoder.layers.mlp.experts") for n in outputs["moe/alltoall"])
