"""A divergence in logged metrics only is located at the call that recorded the metric."""

import pytest

pytest.importorskip("megatron.core")

from shardcheck.megatron.audit.divergence import Gap  # noqa: E402
from shardcheck.megatron.audit.findings import _metric_record  # noqa: E402
from shardcheck.megatron.audit.outcome import Outcome  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.megatron.scenarios.reference import RECORDED, recorded_at  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

RECORD = "megatron/core/transformer/moe/router.py:695 in apply_z_loss"  # Megatron-LM 4abeecce74's parent
DECLARED = {"moe/z_loss": RECORDED + RECORD,
            "decoder.layers.0.mlp.router.weight": "has no tensor_model_parallel (built at router.py:80 in __init__)"}


def _outcome(*names: str) -> Outcome:
    return Outcome(Case("moe", (("moe_z_loss_coeff", 0.1),), Layout(tp=2, sp=True)),
                   gaps=[Gap(name, 2.1, 2.0, 0.1, 0.05, 1e-6) for name in names], declared=DECLARED)


def test_a_metric_only_divergence_is_located_at_the_call_that_recorded_it():
    assert recorded_at(DECLARED, "moe/z_loss") == RECORD
    assert _metric_record(_outcome("moe/z_loss")) == "megatron/core/transformer/moe/router.py:695"


def test_a_divergence_beyond_the_metrics_keeps_its_own_location():
    assert recorded_at(DECLARED, "decoder.layers.0.mlp.router.weight") is None  # a parameter's declaration
    assert _metric_record(_outcome("moe/z_loss", "grad/decoder.layers.0.mlp.router.weight")) is None
    assert _metric_record(_outcome("loss")) is None
