"""``shardcheck train`` builds Megatron's ``HybridModel`` for ``--hybrid-layer-pattern``.

As Megatron-LM's ``hybrid_builders.py`` does, on megatron-core's hybrid stack spec, which is
Transformer Engine's (its ``HybridStack`` builds its final norm with ``TENorm``): so on TE's CPU
layer, and refused in one line on Megatron's local layers. Megatron's functional test
``hybrid/hybrid_mr_mcore_te_tp2_pp1_cp1_dgx_a100_1N8G`` (Mamba, MLP and attention layers at TP2;
the repository carries it) runs through ``--model-config`` and agrees with one rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from test_train import BASE  # skips this module where test_train is skipped (megatron-core < 0.19)
from test_train_te import TE, needs_te

from shardcheck.cli import main
from shardcheck.megatron.train.args import TrainInputError, plan_runs
from shardcheck.megatron.train.config import flags_from_model_config, shrink_pattern

pytestmark = pytest.mark.timeout(900)

HYBRID = Path(__file__).parent / "data" / "megatron-golden" / "head" / "hybrid"
TP2_CONFIG = HYBRID / "hybrid_mr_mcore_te_tp2_pp1_cp1_dgx_a100_1N8G" / "model_config.yaml"
INFERENCE_CONFIG = HYBRID / "hybrid_dynamic_inference_tp1_pp1_dp8_2b_async_sched_async" / "model_config.yaml"
MAMBA = ["--hybrid-layer-pattern", "M-*", "--mamba-head-dim", "16", "--mamba-num-groups", "2"]
SPEC = ["megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]
SAME_INIT = ("the parallel run starts from the one-rank run's initial weights (Megatron's own torch_dist save and "
             "load): a Mamba mixer draws its A_log, dt_bias and conv1d weights per tensor-parallel shard")


def _value(flags: list[str], flag: str) -> str:
    return flags[flags.index(flag) + 1]


def test_a_pattern_shrinks_to_each_kind_of_layer_once_per_pipeline_segment_and_mtp_depth():
    assert shrink_pattern("M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-") == "M-*"
    assert shrink_pattern("M-M-M-M*-M-|M-M-M*-M-M-|M-M*-M-M-M-|M*-M-M-M-M-") == "M-*|M-*|M-*|M*-"
    assert shrink_pattern("MEMEM*EMEME/MM/MM") == "ME*/M/M"


def test_the_functional_configs_pattern_mamba_sizes_and_spec_shrink_into_flags():
    shrunk = flags_from_model_config(TP2_CONFIG)
    assert _value(shrunk.flags, "--hybrid-layer-pattern") == "M-*"
    assert ("--hybrid-layer-pattern M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M- -> M-*: each kind of layer once "
            "per pipeline segment, in its order") in shrunk.mapping
    assert "--mamba-num-groups 2 added: Megatron's default is for a hidden size of thousands" in shrunk.mapping
    # the YAML writes --spec as a list, "[module name]": its two values
    spec = shrunk.flags.index("--spec")
    assert shrunk.flags[spec + 1:spec + 3] == SPEC


@needs_te
def test_the_functional_config_plans_on_te_and_mamba_under_tp_starts_from_the_one_rank_weights():
    shrunk = flags_from_model_config(TP2_CONFIG)
    plan = plan_runs(shrunk.flags, shrunk.nproc, 2, own_entry=True)  # its --spec names what the entry builds
    assert SAME_INIT in plan.changes
    with pytest.raises(TrainInputError, match=r"^--spec: shardcheck's entry point does not build a layer spec"):
        plan_runs([*BASE, *TE, *MAMBA, "--spec", "my.specs", "stack"], 2, 1, own_entry=True)


def test_a_hybrid_pattern_on_megatrons_local_layers_is_refused_in_one_line():
    with pytest.raises(TrainInputError) as refused:
        plan_runs([*BASE, *MAMBA, "--transformer-impl", "local"], 2, 1, own_entry=True)
    assert str(refused.value) == (
        "--hybrid-layer-pattern with Megatron's local layers: megatron-core's hybrid stack spec is Transformer "
        "Engine's, and its HybridStack builds its final norm with TENorm; give --transformer-impl transformer_engine")


@needs_te
def test_sparse_attention_layers_of_a_pattern_are_refused_in_one_line_as_the_dsa_variant_is():
    with pytest.raises(TrainInputError, match=r"^--hybrid-layer-pattern with D layers cannot run on a CPU: its "
                                              r"indexer's Hadamard rotation is the fast_hadamard_transform CUDA kernel"):
        plan_runs([*BASE, *TE, "--hybrid-layer-pattern", "M*D", "--disable-bias-linear"], 2, 1, own_entry=True)


@needs_te
def test_the_one_rank_run_takes_the_pattern_without_its_pipeline_stages():
    """On one rank the stages of ``|`` would become virtual pipeline stages."""
    plan = plan_runs([*BASE, *TE, "--hybrid-layer-pattern", "M-|*-", "--pipeline-model-parallel-size", "2"], 2, 1,
                     own_entry=True)
    assert _value(plan.parallel, "--hybrid-layer-pattern") == "M-|*-"
    assert _value(plan.reference, "--hybrid-layer-pattern") == "M-*-"
    assert "one-rank run: --hybrid-layer-pattern M-*-, without the pipeline stages (|) that split it" in plan.changes


def test_an_inference_config_whose_model_is_its_checkpoints_is_refused_in_one_line():
    shrunk = flags_from_model_config(INFERENCE_CONFIG)
    with pytest.raises(TrainInputError, match=r"^--use-checkpoint-args: the model's shape comes from the "
                                              r"checkpoint of --load, and the runs train a new model"):
        plan_runs(shrunk.flags, shrunk.nproc, 2, own_entry=True)


@needs_te
def test_the_hybrid_functional_test_builds_its_pattern_on_te_and_agrees_with_one_rank():
    result = CliRunner().invoke(main, ["train", "--model-config", str(TP2_CONFIG), "--steps", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"changed: {SAME_INIT}" in lines
    for run in ("4-rank run", "one-rank run"):
        assert f"built: {run}: layer 0: MambaLayer on TE; layer 1: MLP on TE; layer 2: SelfAttention on TE" in lines
    assert lines[-1] == "verdict: AGREE"
