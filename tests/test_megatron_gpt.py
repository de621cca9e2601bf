"""The real megatron-core GPT on Gloo ranks, run by the plain runner (no checker, no pool),
matches its one-rank reference: CP with a mask and per-token loss, MoE under tp, sp and ep.

The plain GPT on correct layouts is test_audit's (checked, at these tolerances in fp32), and
CP with a mask but without per-token loss is a known bug there and in test_megatron_parity."""

import pytest

pytest.importorskip("megatron.core")

import megatron.core.pipeline_parallel.schedules  # noqa: E402, F401  (imported once, before forking)

from shardcheck.megatron.cpu.runner import relative_errors, run_layout, worst  # noqa: E402
from shardcheck.megatron.scenarios import scenario  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow
ONE = Layout()


def test_context_parallel_with_a_mask_and_per_token_loss_matches():
    masked = scenario("gpt", loss_mask=True, optimizer_step=False,
                      config={"calculate_per_token_loss": True})
    reference = run_layout(masked, ONE)
    errors = relative_errors(run_layout(masked, Layout(cp=2)), reference)
    assert worst(errors, "grad/")[1] < 1e-5


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_gpt_matches_one_rank_under_tp_sp_and_expert_parallelism(dispatcher):
    moe = scenario("moe", optimizer_step=False, config={"moe_token_dispatcher_type": dispatcher})
    reference = run_layout(moe, ONE)
    for layout in (Layout(tp=2, sp=True), Layout(dp=2, ep=2)):
        errors = relative_errors(run_layout(moe, layout), reference)
        assert worst(errors)[1] < 1e-5, (layout, worst(errors))
    assert any(k.startswith("grad/decoder.layers.mlp.experts") for k in reference)


@pytest.mark.slow
def test_alltoall_moe_with_tensor_and_expert_parallelism_matches_one_rank():
    """tp x ep gathers uneven token pieces over tp (the uneven-collectives CPU patch)."""
    moe = scenario("moe", optimizer_step=False, config={"moe_token_dispatcher_type": "alltoall"})
    errors = relative_errors(run_layout(moe, Layout(tp=2, dp=2, ep=2, sp=True)), run_layout(moe, ONE))
    assert worst(errors)[1] < 1e-5, worst(errors)
