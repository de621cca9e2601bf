"""The option space: integer and optional integer config fields are swept (n -> n + 1; None ->
the smallest value the config accepts), next to booleans, Literals and Enums."""

from typing import Optional

import pytest

from shardcheck.megatron.audit.sweep import integer_values

OPTIONAL_INT = Optional[int]  # noqa: UP045 - as Megatron writes its fields
OPTIONAL_FLOAT = Optional[float]  # noqa: UP045


@pytest.mark.parametrize(("annotation", "default", "expected"), [
    (int, 4, [5]), (OPTIONAL_INT, None, [1, 2, 4, 8]), (int | None, 3, [4]),
    (bool, False, []), (float, 0.0, []), (OPTIONAL_FLOAT, None, []), (str, "x", []),
])
def test_integer_fields_get_a_neighbour_value(annotation, default, expected):
    assert integer_values(annotation, default) == expected


def test_the_gpt_sweeps_integer_fields_and_leaves_its_sizes_to_the_setup():
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.sweep import component_options

    options = dict(component_options("gpt"))
    assert options["mtp_num_layers"] == 1 and options["num_query_groups"] == 1
    assert not {"num_layers", "hidden_size", "num_attention_heads"} & set(options)
    assert "tensor_model_parallel_size" not in options  # a layout's field
    moe = dict(component_options("moe"))
    integers = [name for name, value in moe.items() if type(value) is int]
    assert moe["moe_router_topk"] == 3 and integers and all(name.startswith("moe_") for name in integers)


def test_set_values_are_taken_as_the_fields_they_set_take_them():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import AttnBackend

    from shardcheck.megatron.audit.fixed_options import OptionError, checked_value

    assert checked_value("output_loss", "label_smoothing", 1) == 1  # a float field takes an int
    assert checked_value("output_loss", "runtime_gather_output", None) is None  # bool | None
    assert checked_value("gpt", "normalization", "RMSNorm") == "RMSNorm"  # a Literal's choice
    assert checked_value("gpt", "attention_backend", "local") is AttnBackend.local  # an Enum by name
    assert checked_value("gpt", "attention_backend", "AttnBackend.local") is AttnBackend.local  # as printed
    assert checked_value("gpt", "init_method", "anything") == "anything"  # a callable: not checkable
    with pytest.raises(OptionError, match="takes true or false, not 'yes'"):
        checked_value("moe_router", "padding", "yes")
    with pytest.raises(OptionError, match="takes an integer or none, not 0.5"):
        checked_value("gpt", "num_query_groups", 0.5)


LIMITED = (("moe_router_topk_limited_devices", 1),)  # Megatron makes it moe_router_num_groups=ep
GROUPED = (("moe_router_num_groups", 2), ("moe_router_group_topk", 1))  # the same, spelled out


def test_options_that_take_their_meaning_from_a_parallel_size_are_found():
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.sweep import layout_dependent_fields
    from shardcheck.parity.layout import Layout

    expert_parallel = Layout.parse("dp2-ep2")
    assert layout_dependent_fields("moe", LIMITED, expert_parallel) == {"moe_router_num_groups": (2, 1)}
    assert layout_dependent_fields("moe", LIMITED, Layout.parse("dp2")) == {}  # ep=1 as on one rank
    assert layout_dependent_fields("moe", GROUPED, expert_parallel) == {}
    assert layout_dependent_fields("moe", (), expert_parallel) == {}


def test_an_option_whose_config_does_not_build_is_listed_as_not_swept_with_why(monkeypatch):
    """Neither a value megatron-core rejects nor one the sweep's own build fails on is dropped
    silently: each is left out of the plan and listed, with the exception's last line."""
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.sweep import BUILD_FAILS, CONFIG_REJECTS, sweep_plan
    from shardcheck.megatron.scenarios import gpt
    from shardcheck.parity.layout import Layout

    built = gpt.transformer_config

    def breaks_on_qk_layernorm(layout, setup, **extra):
        if setup.config.get("qk_layernorm"):
            raise RuntimeError("our build broke")
        return built(layout, setup, **extra)

    monkeypatch.setattr(gpt, "transformer_config", breaks_on_qk_layernorm)
    cases, unbuilt = sweep_plan(["gpt"], [Layout(tp=2)])
    ours = ("gpt", (("qk_layernorm", True),))
    assert unbuilt[ours] == f"{BUILD_FAILS}: RuntimeError: our build broke"
    assert unbuilt[("gpt", (("fp8_param", True),))] == (
        f"{CONFIG_REJECTS}: ValueError: fp8_param must be used together with fp8 mode.")
    assert not {(case.component, case.options) for case in cases} & set(unbuilt)


def test_the_audit_lists_the_plans_unbuilt_options_as_not_swept():
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.run import audit
    from shardcheck.megatron.audit.runner import Pools

    class NoRanks(Pools):  # no case runs: only the CPU patch status is asked for
        def run(self, layout, function, *args, **kwargs):
            return [{}]

    unbuilt = {("gpt", (("fp8_param", True),)): "TransformerConfig rejects it: ValueError: needs fp8"}
    result = audit([], unbuilt=unbuilt, run_pools=NoRanks())
    assert result.not_swept == ["gpt {'fp8_param': True}: TransformerConfig rejects it: ValueError: needs fp8"]


def test_a_component_sweeps_the_path_options_its_own_code_reads(tmp_path, monkeypatch):
    """The MoE GPT's sweep holds the per-token loss, read by the router's auxiliary-loss
    scaling (Megatron-LM #5047 fixed a TP bug there), besides its ``moe_`` fields: the fields a
    component's ``config_code`` reads as ``config.NAME``, whatever their prefix."""
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.sweep import component_options, fields_read

    package = tmp_path / "own_code"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "layer.py").write_text(
        "def f(self, config):\n"
        "    return self.config.calculate_per_token_loss, config.no_such_field, myconfig.add_bias_linear\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fields_read(("own_code",)) == {"calculate_per_token_loss"}
    assert fields_read(("own_code.layer", "no_such_module")) == {"calculate_per_token_loss"}
    moe = component_options("moe")
    assert ("calculate_per_token_loss", True) in moe
    assert ("moe_z_loss_coeff", 0.1) in moe  # an auxiliary loss's weight, off by default
    assert "calculate_per_token_loss" in fields_read(("megatron.core.transformer.moe",))


def test_a_field_that_takes_a_string_or_a_list_keeps_one_string_as_a_string():
    """``--set moe_router_load_balancing_type=seq_aux_loss`` is the string the field takes (a
    list of one would need a list of coefficients); a comma still gives a list."""
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.sweep import config_value

    assert config_value("moe_router_load_balancing_type", "seq_aux_loss") == "seq_aux_loss"
    assert config_value("moe_router_load_balancing_type", "aux_loss,seq_aux_loss") == ["aux_loss", "seq_aux_loss"]
    assert config_value("recompute_modules", "core_attn") == ["core_attn"]  # a list field only
    assert config_value("moe_router_topk", 3) == 3


def test_a_sequence_level_aux_loss_is_swept_with_the_per_token_loss_where_the_code_reads_it():
    """Megatron-LM e3fe5508c9 (#5798) needs both options at once: only together is the loss
    split-free, so that the one-rank reference takes the whole batch in one micro-batch."""
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.sweep import components_plan, option_bundles, split_free_bundles
    from shardcheck.parity.layout import Layout

    bundle = (("moe_router_load_balancing_type", "seq_aux_loss"), ("calculate_per_token_loss", True))
    assert split_free_bundles("moe") == [bundle] and bundle in option_bundles("moe")
    assert split_free_bundles("gpt") == [] and bundle not in option_bundles("gpt")  # no router in its code
    assert ("moe", bundle) in {(case.component, case.options) for case in components_plan(["moe"], [Layout(dp=2)])}
