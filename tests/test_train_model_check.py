"""``shardcheck train`` builds the model the flags ask for, or says in one line that it did not.

Flags shardcheck's entry point does not build are refused before any rank starts; a model
that lacks what its flags ask for (an entry script that drops a module) stops both runs with
one line naming the flag; a correct run prints the module classes of both runs' layers.
Megatron-LM's own ``pretrain_gpt.py`` (tests/data/megatron-lm-entry) runs as ``--entry``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from test_train import BASE  # skips this module where test_train is skipped (megatron-core < 0.19)

from shardcheck.cli import main
from shardcheck.cli.train import _model_mismatch
from shardcheck.megatron.train.args import NOT_BUILT, TrainInputError, plan_runs
from shardcheck.megatron.train.model_check import summary
from shardcheck.parity.launch import RankExit, ScriptRun

pytestmark = pytest.mark.timeout(900)

TP2 = ["--tensor-model-parallel-size", "2"]
MOE_EP2 = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
           "--disable-bias-linear", "--expert-model-parallel-size", "2"]
MEGATRON_LM_ENTRY = Path(__file__).parent / "data" / "megatron-lm-entry" / "pretrain_gpt.py"
REFUSED = {"--spec": ["megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"], "--sft": []}
# a Llama-Nemotron-style model: per layer, attention or MLP full, left out (no_op) or a linear layer
HETEROGENEOUS = ["--num-layers", "4", "--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
                 "--num-query-groups", "2", "--position-embedding-type", "rope", "--rotary-percent", "1.0",
                 "--use-rope-scaling", "--rotary-base", "500000", "--rope-scaling-factor", "8.0",
                 "--untie-embeddings-and-output-weights", "--use-rotary-position-embeddings",
                 "--heterogeneous-layers-config-path", str(Path(__file__).parent / "data" / "heterogeneous-layers.json")]


def _invoke(*args: str):
    return CliRunner().invoke(main, ["train", *args])


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return result.stderr.strip().splitlines()[-1]


def test_every_flag_the_entry_point_does_not_build_is_listed():
    assert set(REFUSED) == set(NOT_BUILT)


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_a_flag_the_entry_point_does_not_build_is_refused_in_one_line_before_any_run(flag):
    result = _invoke("-n", "2", "--", *BASE, flag, *REFUSED[flag])
    line = _one_error_line(result)
    assert line.startswith(f"Error: {flag}: shardcheck's entry point does not build ")
    assert line.endswith("yet; run Megatron-LM's own pretrain_gpt.py with --entry PATH/pretrain_gpt.py")
    assert "changed:" not in result.output  # refused while planning, before any rank started


def test_with_an_entry_script_those_flags_are_the_scripts_to_build():
    spec = ["--spec", *REFUSED["--spec"]]
    plan_runs([*BASE, *spec], 2, 1)
    with pytest.raises(TrainInputError, match="--spec"):
        plan_runs([*BASE, *spec], 2, 1, own_entry=True)


@pytest.mark.parametrize("own_entry", [True, False])
def test_a_heterogeneous_layers_json_without_its_path_is_refused_even_for_an_entry_script(own_entry):
    """megatron-core reads the JSON only where the path is given: Megatron-LM's script would train a plain GPT."""
    with pytest.raises(TrainInputError, match="^--heterogeneous-layers-config-encoded-json without "
                                              "--heterogeneous-layers-config-path: megatron-core builds"):
        plan_runs([*BASE, "--heterogeneous-layers-config-encoded-json", "{}"], 2, 1, own_entry=own_entry)


def test_mtp_on_a_custom_pipeline_layout_is_refused_in_one_line():
    result = _invoke("-n", "2", "--", *BASE, "--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Et|tmL")
    assert _one_error_line(result).startswith("Error: --mtp-num-layers with --pipeline-model-parallel-layout: "
                                              "shardcheck's entry point does not build MTP layers")


def test_layer_summary_merges_runs_of_equal_layers_and_names_the_mtp_block():
    lines = {0: "SelfAttention + MLP", 1: "SelfAttention + MLP", 2: "GatedDeltaNet + MoELayer (4 experts)",
             3: "SelfAttention + MLP", -1: "MultiTokenPredictionBlock (1 layer(s))"}
    assert summary(lines) == ("layers 0-1: SelfAttention + MLP; layer 2: GatedDeltaNet + MoELayer (4 experts); "
                              "layer 3: SelfAttention + MLP; mtp: MultiTokenPredictionBlock (1 layer(s))")
    assert summary({}) == "no layers recorded"


def test_the_model_checks_line_is_found_in_a_failed_ranks_output_and_nothing_else_is():
    trace = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
             "shardcheck.megatron.train.model_check.ModelMismatchError: --mtp-num-layers 1 asks for it\n")
    outcome = ScriptRun([RankExit(0, 1, "RuntimeError: other\n"), RankExit(1, 1, trace)], 60)
    assert _model_mismatch(outcome) == "--mtp-num-layers 1 asks for it"
    assert _model_mismatch(ScriptRun([RankExit(0, 1, "ValueError: NotModelMismatchError: x\n")], 60)) is None


DROPS_EXPERTS = """\
from megatron.core.models.gpt import gpt_layer_specs
from shardcheck.megatron.train import entry

# planted: the layer spec built without the experts --num-experts asks for
entry._layer_spec = lambda args, config, *_: gpt_layer_specs.get_gpt_layer_local_spec(None, False, False)
entry._pretrain()
"""
DROPS_MTP = """\
from shardcheck.megatron.train import entry

entry._mtp_spec = lambda *_: None  # planted: shardcheck's entry point before it built the MTP block
entry._pretrain()
"""
DROPS_MLA = """\
from megatron.core.models.gpt import gpt_layer_specs
from shardcheck.megatron.train import entry

# planted: the layer spec built without the multi-latent attention --multi-latent-attention asks for
entry._layer_spec = lambda *_: gpt_layer_specs.get_gpt_layer_local_spec()
entry._pretrain()
"""
DROPS_HETEROGENEOUS = """\
from megatron.core.models.gpt import gpt_layer_specs
from shardcheck.megatron.train import entry

# planted: every layer built as a plain one, whatever the heterogeneous layers config's block says
entry._layer_spec = lambda *_: gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
entry._pretrain()
"""
MISSING = {
    "experts dropped": (DROPS_EXPERTS, MOE_EP2, "Error: --num-experts asks for 4 experts at this layer "
                        "(--moe-layer-freq), but the built model's MLP is MLP (layer 0)"),
    "no mtp block": (DROPS_MTP, [*TP2, "--mtp-num-layers", "1", "--position-embedding-type", "rope"], "Error: --mtp-num-layers 1 asks for "
                     "a multi-token prediction block, but the built model has none"),
    "no mla": (DROPS_MLA, [*TP2, "--multi-latent-attention"], "Error: --multi-latent-attention asks "
               "for multi-latent attention, but the built model's attention is SelfAttention (layer 0)"),
    "heterogeneous blocks": (DROPS_HETEROGENEOUS, [*TP2, *HETEROGENEOUS], "Error: --heterogeneous-layers-config-path "
                             "asks for no attention at this layer (its block's no_op), but the built model's "
                             "attention is SelfAttention (layer 1)"),
}


@pytest.mark.parametrize("case", sorted(MISSING))
def test_a_built_model_that_lacks_what_its_flags_ask_for_stops_in_one_line(case, tmp_path):
    """The model check runs on whatever ``pretrain`` built, an entry script's model included."""
    script, flags, expected = MISSING[case]
    entry = tmp_path / "entry.py"
    entry.write_text(script)
    result = _invoke("-n", "2", "--steps", "1", "--entry", str(entry), "--", *BASE, *flags)
    assert _one_error_line(result) == expected


def test_a_correct_heterogeneous_tp2_run_prints_and_writes_the_layers_both_runs_built(tmp_path):
    """Each block as its config says (layer 2: linear layers in place of attention and MLP), at
    TP2 as on one rank."""
    result = _invoke("-n", "2", "--steps", "1", "--out", str(tmp_path), "--", *BASE, *TP2, *HETEROGENEOUS)
    assert result.exit_code == 0, result.output
    layers = ("layer 0: SelfAttention + MLP; layer 1: MLP; layer 2: ColumnParallelLinearGathered + "
              "ColumnParallelLinearGathered; layer 3: SelfAttention")
    built = [f"built: 2-rank run: {layers}", f"built: one-rank run: {layers}"]
    lines = result.output.splitlines()
    assert [ln for ln in lines if ln.startswith("built:")] == built
    assert (tmp_path / "layers.txt").read_text().splitlines() == built
    assert lines[-1] == "verdict: AGREE"


def test_megatron_lms_pretrain_gpt_runs_as_the_entry_and_agrees_at_tp2():
    """Its folder goes first on sys.path, as under ``python pretrain_gpt.py``: it imports its
    gpt_builders.py and model_provider.py."""
    result = _invoke("-n", "2", "--steps", "2", "--entry", str(MEGATRON_LM_ENTRY), "--", *BASE, *TP2)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "built: 2-rank run: layers 0-1: SelfAttention + MLP" in lines
    assert lines[-1] == "verdict: AGREE"


def test_moe_layer_freq_puts_experts_on_every_other_layer_and_agrees_under_expert_parallelism():
    """shardcheck's entry point used to put experts on every layer whatever --moe-layer-freq said
    (the model check's first catch); it builds Megatron's decoder-block spec now."""
    result = _invoke("-n", "2", "--steps", "1", "--", *BASE, *MOE_EP2, "--moe-layer-freq", "2")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert ("built: 2-rank run: layer 0: SelfAttention + MoELayer (4 experts); layer 1: SelfAttention + MLP"
            in lines)
    assert lines[-1] == "verdict: AGREE"


class SelfAttention:
    """Stands for megatron-core's SelfAttention: a layer's attention that is no linear attention."""


def _layers(attentions: list[object]) -> list[object]:
    from megatron.core.transformer.mlp import MLP

    return [SimpleNamespace(layer_number=i + 1, self_attention=a, mlp=MLP.__new__(MLP))
            for i, a in enumerate(attentions)]


def test_gated_delta_nets_are_expected_where_linear_attention_freq_puts_them():
    """--linear-attention-freq 2: linear attention at layers 0 and 2, full attention at 1 and 3."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from shardcheck.megatron.train.model_check import _layer_mismatches

    config = SimpleNamespace(num_layers=4, experimental_attention_variant="gated_delta_net",
                             linear_attention_freq=2, multi_latent_attention=False, num_moe_experts=None)
    gdn = GatedDeltaNet.__new__(GatedDeltaNet)
    hybrid = _layers([gdn, SelfAttention(), gdn, SelfAttention()])
    assert [line for layer in hybrid for line in _layer_mismatches(layer, config)] == []
    plain = _layers([SelfAttention()] * 4)
    assert [line for layer in plain for line in _layer_mismatches(layer, config)] == [
        f"--experimental-attention-variant gated_delta_net asks for a gated delta net at this layer "
        f"(--linear-attention-freq), but the built model's attention is SelfAttention (layer {i})" for i in (0, 2)]


def test_a_layer_that_is_no_transformer_layer_is_named_by_its_class_and_not_judged_without_a_pattern():
    """A Mamba layer without a hybrid pattern to judge it by: listed, not checked."""
    from shardcheck.megatron.train.model_check import _layer_mismatches, layer_lines

    class MambaLayer:
        layer_number = 1

    config = SimpleNamespace(num_layers=1, experimental_attention_variant=None, multi_latent_attention=True,
                             num_moe_experts=None)
    assert _layer_mismatches(MambaLayer(), config) == []
    chunk = SimpleNamespace(decoder=SimpleNamespace(layers=[MambaLayer(), *_layers([SelfAttention()])[:1]]))
    chunk.decoder.layers[1].layer_number = 2
    assert layer_lines([chunk]) == {0: "MambaLayer", 1: "SelfAttention + MLP"}


def test_a_transformer_engine_run_whose_layer_holds_no_te_module_is_a_mismatch():
    """--transformer-impl transformer_engine kept: each layer must hold Megatron's TE modules
    (extensions/transformer_engine.py), and its built: line says ``on TE``."""
    import torch

    from shardcheck.megatron.train.model_check import _describe, _layer_mismatches

    class TELayerNormColumnParallelLinear(torch.nn.Module):
        """Stands for Megatron's TE linear: a class of ``extensions/transformer_engine.py``."""

    TELayerNormColumnParallelLinear.__module__ = "megatron.core.extensions.transformer_engine"

    def layer(*modules: torch.nn.Module) -> torch.nn.Module:
        built = torch.nn.Module()
        built.layer_number, built.self_attention, built.mlp = 1, torch.nn.Sequential(*modules), torch.nn.Identity()
        return built

    config = SimpleNamespace(num_layers=1, experimental_attention_variant=None, multi_latent_attention=False,
                             num_moe_experts=None, transformer_impl="transformer_engine")
    on_te = layer(TELayerNormColumnParallelLinear())
    assert _layer_mismatches(on_te, config) == []
    assert _describe(on_te).endswith(" on TE")
    local = layer(torch.nn.Linear(2, 2))
    assert _layer_mismatches(local, config) == [
        "--transformer-impl transformer_engine asks for Transformer Engine's layers, but the built model's "
        "layer 0 holds none"]
    assert not _describe(local).endswith(" on TE")


def _bare(cls: type) -> object:
    """An instance of megatron-core's module class ``cls``, its own __init__ not run."""
    import torch

    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    return module


def _hybrid_layers(kinds: str) -> list[object]:
    """A hybrid model's decoder layers as megatron-core builds them for the symbols ``kinds``:
    a MambaLayer, or a layer whose attention or MLP is an IdentityOp."""
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = []
    for number, kind in enumerate(kinds, start=1):
        if kind == "M":
            layer = _bare(MambaLayer)
            layer.layer_number = number
        else:
            attention, mlp = {"*": (SelfAttention, IdentityOp), "-": (IdentityOp, MLP), "E": (IdentityOp, MoELayer)}[kind]
            layer = SimpleNamespace(layer_number=number, self_attention=_bare(attention), mlp=_bare(mlp))
        layers.append(layer)
    return layers


HYBRID_CONFIG = SimpleNamespace(num_layers=4, experimental_attention_variant=None, multi_latent_attention=False,
                                num_moe_experts=4, transformer_impl="local")


def test_every_symbol_of_megatrons_hybrid_patterns_names_a_kind_of_layer():
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols

    from shardcheck.megatron.train.model_check import hybrid_layer_kinds

    assert set(hybrid_layer_kinds()) == Symbols.VALID_LAYERS


def test_the_hybrid_pattern_is_read_without_its_pipeline_stages_and_mtp_depths():
    from shardcheck.megatron.train.model_check import _hybrid_pattern

    args = SimpleNamespace(hybrid_layer_pattern="M-|*E/M*", hybrid_override_pattern=None)
    assert _hybrid_pattern(args) == ("--hybrid-layer-pattern", "M-*E")
    # Megatron copies a --hybrid-override-pattern to hybrid_layer_pattern; the line names the flag given
    args = SimpleNamespace(hybrid_layer_pattern="M*", hybrid_override_pattern="M*")
    assert _hybrid_pattern(args) == ("--hybrid-override-pattern", "M*")
    assert _hybrid_pattern(SimpleNamespace(hybrid_layer_pattern=None)) is None


def test_a_hybrid_model_with_the_patterns_layers_passes_and_its_layers_are_listed():
    """M, -, *, E: a Mamba layer, a dense MLP, self-attention, experts (megatron-core's Symbols);
    the experts are judged by the pattern, not by --moe-layer-freq as in a GPT."""
    from shardcheck.megatron.train.model_check import _layer_mismatches, layer_lines, summary

    layers = _hybrid_layers("M-*E")
    assert [line for layer in layers for line in _layer_mismatches(layer, HYBRID_CONFIG, ("--hybrid-layer-pattern",
                                                                                          "M-*E"))] == []
    chunk = SimpleNamespace(decoder=SimpleNamespace(layers=layers))
    assert summary(layer_lines([chunk])) == ("layer 0: MambaLayer; layer 1: MLP; layer 2: SelfAttention; "
                                             "layer 3: MoELayer")


def test_a_hybrid_model_without_the_patterns_layers_is_a_mismatch_per_layer():
    from shardcheck.megatron.train.model_check import _layer_mismatches

    pattern = ("--hybrid-layer-pattern", "M-*E")
    built = _hybrid_layers("*--M")  # attention for Mamba, a dense MLP for attention, Mamba for experts
    assert [line for layer in built for line in _layer_mismatches(layer, HYBRID_CONFIG, pattern)] == [
        "--hybrid-layer-pattern asks for a Mamba layer at layer 0 ('M'), but the built model's layer 0 is "
        "SelfAttention",
        "--hybrid-layer-pattern asks for self-attention at layer 2 ('*'), but the built model's layer 2 is MLP",
        "--hybrid-layer-pattern asks for experts at layer 3 ('E'), but the built model's layer 3 is MambaLayer"]
    extra = _hybrid_layers("M-*E-")[-1]
    assert _layer_mismatches(extra, HYBRID_CONFIG, pattern) == [
        "--hybrid-layer-pattern asks for 4 layers, but the built model has a layer 4"]
