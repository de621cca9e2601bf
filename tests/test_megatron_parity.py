"""Megatron scenarios run through shardcheck's parity engine and warm rank pool."""

import pytest

pytest.importorskip("megatron.core")

import megatron.core.pipeline_parallel.schedules  # noqa: E402, F401  (imported once, before forking)
from parity_scenarios import compared_clean  # noqa: E402

from shardcheck.megatron.scenarios import scenario  # noqa: E402
from shardcheck.parity.compare import parity  # noqa: E402
from shardcheck.parity.pool import RankPool  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, timeout=300) as ranks:
        yield ranks


def _check(pool, scenario_fn, layouts):
    return parity(scenario_fn, layouts, pool=pool, noise_runs=0, typecheck=False, timeout=300)


def test_plain_gpt_train_step_has_no_finding_on_correct_layouts(pool):
    """The parity engine on a Megatron scenario: a sequence shard over tp, CP's load-balanced
    chunks and a dp split rebuilt (the other correct layouts are test_audit's)."""
    layouts = ["tp2-sp", "cp2-dp2"]
    result = _check(pool, scenario("gpt"), layouts)
    assert compared_clean(result, layouts), str(result)


def test_cp_loss_with_a_mask_is_found_in_the_gradients(pool):
    result = _check(pool, scenario("gpt", loss_mask=True, optimizer_step=False), ["cp2"])
    report = result["cp2"]
    assert not result.ok
    assert report.row("output", "loss").ok  # the reported loss is right, its gradients are not
    assert not report.row("output", "grad/embedding.word_embeddings.weight").ok


def test_label_smoothing_under_tp_is_found(pool):
    result = _check(pool, scenario("output_loss", label_smoothing=0.1), ["tp2"])
    assert not result["tp2"].row("output", "grad/weight").ok
    assert compared_clean(_check(pool, scenario("output_loss"), ["tp2", "tp2-sp"]), ["tp2", "tp2-sp"])
