"""The model classes' own constructor and forward arguments in the sweep (GPTModel, T5Model,
LLaVAModel, TopKRouter): found by introspection, routed to the model, checked by ``--set``,
carried into repro scripts, and clean on correct layouts."""

import pytest

pytest.importorskip("megatron.core")

import inspect  # noqa: E402

from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron_release import RELEASE  # noqa: E402

from shardcheck.megatron.audit.findings import ONE_RANK_CRASH  # noqa: E402
from shardcheck.megatron.audit.fixed_options import OptionError, checked_value  # noqa: E402
from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD  # noqa: E402
from shardcheck.megatron.audit.sweep import (  # noqa: E402
    STAGE_ARGUMENTS,
    Case,
    component_options,
    model_class,
    model_options,
    passed_by_scenario,
    setup_kwargs,
)
from shardcheck.megatron.repro.templates import _split_options  # noqa: E402
from shardcheck.megatron.scenarios import COMPONENTS  # noqa: E402
from shardcheck.megatron.scenarios.gpt import GPTSetup  # noqa: E402
from shardcheck.megatron.scenarios.ssm import GDNSetup  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

for module in PRELOAD:
    __import__(module)


def test_the_arguments_the_scenario_leaves_at_their_defaults_are_swept():
    found = dict(model_options("gpt"))
    assert {"GPTModel.rope_scaling", "GPTModel.scatter_embedding_sequence_parallel",
            "GPTModel.forward.runtime_gather_output"} <= set(found)
    passed = passed_by_scenario("gpt", "__init__")
    assert {"share_embeddings_and_output_weights", "position_embedding_type", "vocab_size"} <= passed
    assert {"input_ids", "position_ids", "attention_mask", "labels", "loss_mask", "padding_mask"} == \
        passed_by_scenario("gpt", "forward")
    constructor = {n.split(".", 1)[1] for n in found if not n.startswith("GPTModel.forward.")}
    assert not constructor & passed
    assert constructor <= set(inspect.signature(GPTModel.__init__).parameters)
    assert set(found.items()) <= set(component_options("gpt"))
    assert model_options("moe") == [] and model_options("mtp") == []  # shared: the gpt component's


@pytest.mark.parametrize("component, expected", [
    ("t5", {"T5Model.fp16_lm_cross_entropy", "T5Model.forward.output_encoder_hidden_only"}),
    ("multimodal", {"LLaVAModel.pixel_shuffle", "LLaVAModel.forward.runtime_gather_output"}),
    ("moe_router", {"TopKRouter.is_mtp_layer"})])
def test_each_model_class_gives_its_own_arguments(component, expected):
    names, cls = {name for name, _ in model_options(component)}, model_class(component)
    in_release = {name for name in expected if name.rsplit(".", 1)[1] in inspect.signature(
        getattr(cls, "forward" if ".forward." in name else "__init__")).parameters}
    assert in_release <= names and (in_release or component == "moe_router")  # 0.16.1: no is_mtp_layer
    assert all(name.startswith(f"{cls.__name__}.") for name in names)
    assert not {name.rsplit(".", 1)[1] for name in names} & STAGE_ARGUMENTS  # a layout's to set
    assert not {name.rsplit(".", 1)[1] for name in names} & passed_by_scenario(component, "__init__")


def test_a_model_argument_goes_to_the_model_and_a_config_field_to_the_config():
    kwargs = setup_kwargs(GPTSetup, [("GPTModel.rope_scaling", True), ("loss_mask", True),
                                     ("qk_layernorm", True),
                                     ("GPTModel.forward.runtime_gather_output", False)])
    assert kwargs == {"loss_mask": True, "config": {"qk_layernorm": True},
                      "model_args": {"rope_scaling": True},
                      "forward_args": {"runtime_gather_output": False}}
    setup, overrides = _split_options(COMPONENTS["gpt"].setup, {"GPTModel.rope_scaling": True,
                                                                "qk_layernorm": True})
    assert setup["model_args"] == {"rope_scaling": True} and overrides == {"qk_layernorm": True}
    with pytest.raises(KeyError):
        setup_kwargs(GDNSetup, [("GatedDeltaNet.use_qk_l2norm", False)])  # no model_args field


def test_set_takes_a_model_argument_and_refuses_one_the_class_lacks():
    assert checked_value("gpt", "GPTModel.forward.runtime_gather_output", True) is True
    with pytest.raises(OptionError, match="takes no argument 'nope'"):
        checked_value("gpt", "GPTModel.nope", True)
    with pytest.raises(OptionError, match="no model argument"):
        checked_value("gpt", "T5Model.parallel_output", False)
    with pytest.raises(OptionError, match="true or false"):
        checked_value("t5", "T5Model.fp16_lm_cross_entropy", "yes")


@pytest.mark.slow
@pytest.mark.skipif(RELEASE is not None and RELEASE.release[:2] < (0, 19),
                    reason="0.16.1 crashes there under tp2-sp (cross_entropy.py:59), a layout-only "
                           "crash the audit reports as such")
def test_an_embedding_left_unscattered_under_sequence_parallelism_gives_no_finding():
    cases = [Case("gpt", (("GPTModel.scatter_embedding_sequence_parallel", False),), Layout(tp=2, sp=True))]
    result = audit(cases)
    assert not result.errors and not result.not_swept, (result.errors, result.not_swept)
    assert len(result.outcomes) == 1 and result.findings == []


@pytest.mark.slow
def test_model_arguments_reach_the_model_and_match_one_rank_on_correct_layouts():
    """Three arguments run at tp2 and agree with one rank; a forward argument that makes Megatron
    fail on one rank (its in-place-on-view error) shows that forward arguments reach the model."""
    clean = [("t5", "T5Model.fp16_lm_cross_entropy", True), ("multimodal", "LLaVAModel.pixel_shuffle", True),
             ("gpt", "GPTModel.forward.runtime_gather_output", False)]
    failing = ("gpt", "GPTModel.forward.runtime_gather_output", True)
    result = audit([Case(c, ((name, value),), Layout(tp=2)) for c, name, value in [*clean, failing]])
    assert not result.errors, result.errors
    # megatron-core's own in-place write to the gathered logits on one rank: a one-rank crash
    [crash] = result.findings
    assert crash.kind == ONE_RANK_CRASH and crash.config == {failing[1]: True}, crash
    assert crash.location.startswith("megatron/core/tensor_parallel/cross_entropy.py:"), crash.location
    assert sorted(o.case.component for o in result.outcomes) == sorted(c for c, _, _ in clean)
    assert any("GPTModel.forward.runtime_gather_output" in line and "fails on one rank" in line
               for line in result.not_swept), result.not_swept


def test_a_model_argument_is_never_pruned_as_an_unread_config_field():
    from shardcheck.megatron.audit.sweep import changed_config_fields

    assert changed_config_fields("gpt", (("GPTModel.rope_scaling", True),), Layout(tp=2)) is None
    assert changed_config_fields("gpt", (("GPTModel.forward.runtime_gather_output", False),),
                                 Layout(tp=2)) is None
    assert changed_config_fields("gpt", (("qk_layernorm", True),), Layout(tp=2)) == {"qk_layernorm"}
