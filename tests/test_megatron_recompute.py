"""Recomputation on a CPU: the checkpointed forwards rerun in backward, and change no number
(the audit's runs of it: tests/test_audit_recompute.py)."""

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from shardcheck.megatron.audit.runner import PRELOAD  # noqa: E402
from shardcheck.megatron.audit.sweep import FULL_BUNDLES, components_plan, option_bundles  # noqa: E402
from shardcheck.megatron.cpu.runner import run_layout  # noqa: E402
from shardcheck.megatron.scenarios import scenario  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow
for module in PRELOAD:
    __import__(module)

SELECTIVE = (("recompute_granularity", "selective"),)
RECOMPUTE = [SELECTIVE, *FULL_BUNDLES]


def _one_rank(options: tuple) -> dict[str, np.ndarray]:
    return run_layout(scenario("gpt", config=dict(options)), Layout())


@pytest.fixture(scope="module")
def plain():
    return _one_rank(())


@pytest.mark.parametrize("options", RECOMPUTE, ids=lambda o: "+".join(f"{k}={v}" for k, v in o))
def test_recomputed_step_equals_the_stored_one_on_one_rank(plain, options):
    recomputed = _one_rank(options)
    assert recomputed.keys() == plain.keys()
    grads = [name for name in plain if name.startswith("grad/")]
    assert grads  # gradients went through the recomputed forwards
    for name in plain:
        np.testing.assert_allclose(recomputed[name], plain[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_full_recomputation_is_swept_as_bundles_of_the_fields_megatron_asks_together():
    assert option_bundles("gpt")[:len(FULL_BUNDLES)] == list(FULL_BUNDLES)
    assert option_bundles("output_loss") == []  # no TransformerConfig of its own to recompute
    planned = {case.options for case in components_plan(["gpt"], [Layout(tp=2)])}
    assert set(FULL_BUNDLES) <= planned and SELECTIVE in planned
