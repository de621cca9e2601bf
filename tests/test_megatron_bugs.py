"""Known megatron-core 0.16.1 bugs, each shown against its one-rank reference, with a control."""

import pytest

pytest.importorskip("megatron.core")

import megatron.core.pipeline_parallel.schedules  # noqa: E402, F401  (imported once, before forking)
from megatron_release import fixed_in  # noqa: E402

from shardcheck.megatron.cpu.runner import (  # noqa: E402
    relative_errors,
    run_layout,
    run_ranks,
)
from shardcheck.megatron.scenarios import scenario  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow
ONE, TP2, TP2_SP = Layout(), Layout(tp=2), Layout(tp=2, sp=True)


def test_label_smoothing_under_tp_averages_over_the_local_vocab_shard():
    """tensor_parallel/cross_entropy.py:164-180: vocab_size and mean(log_probs) are per shard."""
    smoothed = scenario("output_loss", label_smoothing=0.1)
    reference = run_layout(smoothed, ONE)
    ranks = run_ranks(smoothed, TP2)
    losses = [float(r["loss"]) for r in ranks]
    assert losses[0] != losses[1]  # the "replicated" loss differs between TP ranks
    for outputs in ranks:
        errors = relative_errors(outputs, reference)
        assert errors["loss"] > 1e-5, (losses, float(reference["loss"]))
        assert errors["grad/weight"] > 1e-3


def test_cross_entropy_without_label_smoothing_matches_under_tp():
    plain = scenario("output_loss")
    errors = relative_errors(run_layout(plain, TP2), run_layout(plain, ONE))
    assert max(errors.values()) < 1e-5, errors


def test_router_local_token_count_is_overwritten_by_the_in_place_all_reduce():
    """moe_utils.py:223-228: local_tokens_per_expert is all-reduced in place, then read as local."""
    padded = scenario("moe_router", padding=True)
    reference = run_layout(padded, ONE)
    observed = run_layout(padded, TP2_SP)
    # summed over TP the "local" counts give twice the one-rank count
    assert (observed["local_num_tokens_summed"] == 2 * reference["local_num_tokens_summed"]).all()


def test_router_local_token_count_is_overwritten_under_context_parallelism_too():
    padded = scenario("moe_router", padding=True)
    observed = run_layout(padded, Layout(cp=2))
    assert (observed["local_num_tokens_summed"] == 2 * run_layout(padded, ONE)["local_num_tokens_summed"]).all()


@pytest.mark.parametrize("layout", [TP2_SP, Layout(cp=2)], ids=str)
def test_router_token_count_without_padding_matches(layout):
    plain = scenario("moe_router")
    errors = relative_errors(run_layout(plain, layout), run_layout(plain, ONE))
    assert max(errors.values()) < 1e-6, errors


@fixed_in("0.19", "the router's per-token aux loss scaled by the rank-local count")
def test_router_per_token_aux_gradient_without_padding_is_off_by_the_tp_size():
    """router.py:465: with calculate_per_token_loss the aux loss is scaled by the rank-local count."""
    per_token = {"calculate_per_token_loss": True}
    plain = scenario("moe_router", config=per_token)
    errors = relative_errors(run_layout(plain, TP2_SP), run_layout(plain, ONE))
    assert errors["grad/weight"] > 0.1
    padded = scenario("moe_router", padding=True, config=per_token)  # the overwritten count cancels it
    errors = relative_errors(run_layout(padded, TP2_SP), run_layout(padded, ONE))
    assert errors["grad/weight"] < 1e-6
