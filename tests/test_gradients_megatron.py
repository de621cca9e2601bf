"""The head-dim norm bug with megatron-core's own tensor-parallel autograd Functions.

copy_to_tensor_model_parallel_region's backward issues the all-reduce of the input gradient;
the checker types it as it runs. (Megatron's sequence-parallel gather allocates on
``torch.cuda.current_device()``, so it cannot run on this CPU-only torch.) 2 Gloo ranks.
"""

import grad_programs as programs
import pytest

from shardcheck.parity.launch import spawn_ranks

pytest.importorskip("megatron.core.tensor_parallel.mappings")
pytestmark = [pytest.mark.megatron, pytest.mark.slow]

EXACT = 1e-5
UNREDUCED = "unreduced gradient"
CASES = {
    "q_norm_summed": (programs.head_norm, True, "megatron"),
    "q_norm_not_summed": (programs.head_norm, False, "megatron"),
}


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(programs.run_cases, 2, CASES, timeout=300)


def test_head_norm_grads(results):
    assert len(results) == 2
    for rank in results:  # each rank checks its own gradients
        good, bad = rank["q_norm_summed"], rank["q_norm_not_summed"]
        assert good["q_norm_diff"] < EXACT and good["violations"] == []
        assert bad["q_norm_diff"] > 1e-3 and bad["q_proj_diff"] < EXACT
        assert bad["violations"] == [(UNREDUCED, "q_norm.weight", "tp"), (UNREDUCED, "q_norm.bias", "tp")]
