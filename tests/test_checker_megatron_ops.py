"""Real megatron-core ops under the checker on 2 Gloo ranks: vocab-parallel cross entropy is
typed end to end, and its label smoothing is flagged (a mean over the local vocab shard)."""

import inspect

import pytest
import torch
import torch.nn.functional as F

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks

cross_entropy = pytest.importorskip("megatron.core.tensor_parallel.cross_entropy")
pytestmark = [pytest.mark.megatron, pytest.mark.slow]

TOKENS, BATCH, VOCAB = 3, 2, 10


def _logits_and_target():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(TOKENS, BATCH, VOCAB, generator=gen), torch.arange(TOKENS * BATCH).view(
        TOKENS, BATCH) % VOCAB


def _vocab_parallel(smoothing: float):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, shard = ps.get_tensor_model_parallel_rank(), VOCAB // 2
    full, target = _logits_and_target()
    local = full[:, :, rank * shard:(rank + 1) * shard].clone().requires_grad_()
    with sc.typecheck(sc.Mesh(tp=ps.get_tensor_model_parallel_group()), mode="collect"):
        logits = sc.annotate(local, tp=sc.S(2))
        loss = vocab_parallel_cross_entropy(logits, sc.annotate(target, tp=sc.R), smoothing)
        loss.sum().backward()
        types = {"loss": repr(sc.typeof(loss)), "grad": repr(sc.typeof(logits.grad))}
    ps.destroy_model_parallel()
    return {**types, "loss_values": loss.detach().tolist(), "coverage": sc.coverage().fraction,
            "violations": [(r.rule, r.location) for r in sc.violations()]}


def _reference(smoothing: float) -> torch.Tensor:
    full, target = _logits_and_target()
    return F.cross_entropy(full.view(-1, VOCAB), target.view(-1), reduction="none",
                           label_smoothing=smoothing).view(TOKENS, BATCH)


def _smoothing_line() -> str:
    lines, start = inspect.getsourcelines(cross_entropy._VocabParallelCrossEntropy.forward)
    offset = next(i for i, line in enumerate(lines) if "smoothing * mean_log_probs" in line)
    return f"{inspect.getsourcefile(cross_entropy)}:{start + offset}"


def test_vocab_parallel_cross_entropy_is_fully_typed():
    for result in spawn_ranks(_vocab_parallel, 2, 0.0):
        assert result["violations"] == [] and result["coverage"] == 1.0
        assert result["loss"] == "{'tp': R}" and result["grad"] == "{'tp': S(2)}"
        torch.testing.assert_close(torch.tensor(result["loss_values"]), _reference(0.0))


def test_label_smoothing_over_the_local_vocab_shard_is_flagged_and_really_wrong():
    for result in spawn_ranks(_vocab_parallel, 2, 0.1):
        assert result["violations"] == [("mean over shard", _smoothing_line())]
        # The bug is real: the loss differs from the one-device label-smoothed loss.
        assert not torch.allclose(torch.tensor(result["loss_values"]), _reference(0.1))
