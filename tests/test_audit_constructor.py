"""GPTModel's own constructor arguments in the sweep: found by introspection, routed to the
model, carried into repro scripts, and clean on correct layouts."""

import pytest

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron_release import RELEASE  # noqa: E402

from shardcheck.megatron.audit.run import PRELOAD, audit  # noqa: E402
from shardcheck.megatron.audit.sweep import (  # noqa: E402
    Case,
    _arguments_passed_by_scenario,
    component_options,
    constructor_options,
    setup_kwargs,
)
from shardcheck.megatron.repro.templates import TEMPLATES, _split_options  # noqa: E402
from shardcheck.megatron.scenarios.gpt import GPTSetup  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

for module in PRELOAD:
    __import__(module)


def test_the_arguments_the_scenario_leaves_at_their_defaults_are_swept():
    found = dict(constructor_options("gpt"))
    assert {"GPTModel.rope_scaling", "GPTModel.scatter_embedding_sequence_parallel"} <= set(found)
    passed = _arguments_passed_by_scenario()
    assert {"share_embeddings_and_output_weights", "position_embedding_type", "vocab_size"} <= passed
    assert not {name.split(".", 1)[1] for name in found} & passed
    assert all(name.split(".", 1)[1] in GPTModel.__init__.__code__.co_varnames for name in found)
    assert set(found.items()) <= set(component_options("gpt"))
    assert constructor_options("moe") == []  # shared GPT arguments are the gpt component's


def test_a_constructor_option_goes_to_the_model_and_a_config_field_to_the_config():
    kwargs = setup_kwargs(GPTSetup, [("GPTModel.rope_scaling", True), ("loss_mask", True),
                                     ("qk_layernorm", True)])
    assert kwargs == {"loss_mask": True, "config": {"qk_layernorm": True},
                      "model_args": {"rope_scaling": True}}
    setup, overrides = _split_options(TEMPLATES["gpt"].setup, {"GPTModel.rope_scaling": True,
                                                               "qk_layernorm": True})
    assert setup["model_args"] == {"rope_scaling": True} and overrides == {"qk_layernorm": True}


@pytest.mark.slow
@pytest.mark.skipif(RELEASE is not None and RELEASE.release[:2] < (0, 19),
                    reason="0.16.1 crashes there under tp2-sp (cross_entropy.py:59), a layout-only "
                           "crash the audit reports as such")
def test_an_embedding_left_unscattered_under_sequence_parallelism_gives_no_finding():
    cases = [Case("gpt", (("GPTModel.scatter_embedding_sequence_parallel", False),), Layout(tp=2, sp=True))]
    result = audit(cases)
    assert not result.errors and not result.not_swept, (result.errors, result.not_swept)
    assert len(result.outcomes) == 1 and result.findings == []


def test_a_constructor_option_is_never_pruned_as_an_unread_config_field():
    from shardcheck.megatron.audit.sweep import changed_config_fields

    assert changed_config_fields("gpt", (("GPTModel.rope_scaling", True),), Layout(tp=2)) is None
    assert changed_config_fields("gpt", (("qk_layernorm", True),), Layout(tp=2)) == {"qk_layernorm"}
