"""A parameter whose ``allreduce`` picks the other kind of DDP buffer (#5916) is located where its
layer's constructor set ``allreduce``, and the gradient norm is where it showed."""

import inspect

import pytest
import torch

pytest.importorskip("megatron.core")

from shardcheck.megatron.audit import report as audit_report  # noqa: E402
from shardcheck.megatron.audit.divergence import CallGap, Gap  # noqa: E402
from shardcheck.megatron.audit.outcome import Outcome  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.megatron.checks.contracts import BY_NAME  # noqa: E402
from shardcheck.megatron.checks.reduction import MISGROUPED, Misgrouped, misgrouped_axes  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

# the DDP's groups on rank 0 of tp2-etp1-sp (dense dp x cp: itself; expert dp: both ranks, the
# tp ranks), as megatron-core builds them
DENSE, EXPERT, TP = {0}, {0, 1}, {0, 1}
KEY = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
SITE = "megatron/core/tensor_parallel/layers.py:1007"


def test_the_declaration_is_blamed_only_where_the_other_buffers_group_holds_the_axis():
    # #5916: the experts kept allreduce=True (the dense buffer, summed over rank 0 alone) while
    # their gradient varies over the tp ranks, which only the expert dp group holds
    assert misgrouped_axes(True, {"tp": TP}, DENSE, EXPERT) == ["tp"]
    # the fix: allreduce=False, the expert buffer sums it over the tp ranks
    assert misgrouped_axes(False, {"tp": TP}, DENSE, EXPERT) == []
    # the converse at dp2-ep2: a dense parameter declared allreduce=False (expert dp: itself)
    # whose gradient varies over dp, which only the dense group holds
    assert misgrouped_axes(False, {"dp": {0, 1}}, {0, 1}, {0}) == ["dp"]
    assert misgrouped_axes(True, {"dp": {0, 1}}, {0, 1}, {0}) == []
    # an axis neither group holds (pp) is no buffer's to sum over
    assert misgrouped_axes(True, {"pp": {0, 2}}, DENSE, EXPERT) == []


@pytest.mark.parametrize("linear", ["ColumnParallelLinear", "RowParallelLinear"])
def test_a_real_expert_linears_allreduce_is_recorded_at_its_constructors_setattr(linear):
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import TransformerConfig

    from shardcheck.megatron.scenarios import reference

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=2,
                               use_cpu_initialization=True)
    cls = getattr(layers, linear)
    extra = {"gather_output": False} if linear == "ColumnParallelLinear" else {"input_is_parallel": True,
                                                                                "skip_bias_add": False}
    with reference.parameter_declarations():
        built = cls(8, 16, config=config, init_method=torch.nn.init.zeros_, bias=True, is_expert=True, **extra)
        [recorder] = reference._RECORDERS
        site = recorder.reduce_sites[id(built.weight)]
    path, line = site.split(" in ")[0].rsplit(":", 1)
    assert path == inspect.getsourcefile(layers) and site.endswith(" in __init__")
    source, first = inspect.getsourcelines(cls.__init__)
    assert first <= int(line) < first + len(source)
    assert "allreduce" in source[int(line) - first]


def _outcome(gaps: list[Gap], violations: list[dict]) -> Outcome:
    norm = Gap("get_grad_norm_fp32#0.total_norm", 1.3434, 1.3509, 0.0075, 0.0056, 1e-4)
    return Outcome(Case("moe", (("seed", 0),), Layout.parse("tp2-etp1-sp")), gaps=[*gaps],
                   call_gap=CallGap("get_grad_norm_fp32", 0, norm), violations=violations)


# rank 0's report of the reverted #5916 at tp2-etp1-sp, as the audit's rank gives it
FOUND = Misgrouped(MISGROUPED, KEY, "tp", True, (0,), (0, 1))
VIOLATION = {"rule": MISGROUPED, "location": SITE, "op": "DistributedDataParallel", "axis": "tp",
             "line": f"checker: {MISGROUPED} at {SITE} in DistributedDataParallel: {FOUND.describe()}"}
GRAD = Gap(f"grad/{KEY}", 0.1, 0.2, 0.1, 0.5, 1e-6)


def test_a_finding_whose_parameter_took_the_other_buffer_is_located_at_its_allreduce():
    outcome = _outcome([GRAD], [VIOLATION])
    key = audit_report._key(outcome)
    assert key == (SITE, audit_report.REDUCTION_CONTRACT)
    assert audit_report.shown_at(key, outcome) == BY_NAME["get_grad_norm_fp32"].location()
    title = audit_report.title(key, outcome)
    assert title.startswith(f"{KEY}: allreduce=True sums its gradient over the DDP's data-parallel group")
    assert "so get_grad_norm_fp32: total_norm differs from one rank under tp2-etp1-sp (seed=0)" in title


def test_a_misgrouped_parameter_whose_gradient_matches_one_rank_locates_nothing():
    # the parameter's gradient is right (another one's differs): the norm stays the location
    outcome = _outcome([Gap("grad/output_layer.weight", 0.1, 0.2, 0.1, 0.5, 1e-6)], [VIOLATION])
    key = audit_report._key(outcome)
    assert key == (BY_NAME["get_grad_norm_fp32"].location(), BY_NAME["get_grad_norm_fp32"].notation())
    assert audit_report.shown_at(key, outcome) is None
