"""The learnable softmax offset under TP: a real megatron-core bug (0.16.1 and 0.19.2).

Each tp rank holds its own heads' offsets (a shard over tp), yet the parameter carries no
``tensor_model_parallel`` attribute, so ``param_is_not_tensor_parallel_duplicate`` takes it for
a replica and the gradient norm counts tp rank 0's heads only. The checker types the parameter
from its ``sharded_state_dict`` cut (S(0) over tp) and reports where the norm's duplicate test
drops it (``shard counted as replica``); the numbers agree with the checker: Megatron's norm is
taken over the global gradients less tp rank 1's offsets, and with the attribute set over all
of them. The gap is about 3e-7 of the norm in this tiny GPT, below parity's tolerance (and
near float32 rounding); parity sees it in what the norm counts per global tensor
(``norm_counted/...``, a share of the offsets' squared gradient), so the audit confirms it.
"""

from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD, pools  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.megatron.cpu.runner import run_layout  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
for module in PRELOAD:
    __import__(module)
LEARNABLE = {"softmax_type": "learnable"}


def _step(ctx, marked: bool) -> dict[str, torch.Tensor]:
    """One GPT training step, with the squares of the gradients Megatron's norm is computed
    from (in float64, summed over the ranks); ``marked``: the offsets carry Megatron's TP-shard
    attributes (the fix)."""
    import torch.distributed as dist
    from megatron.core.optimizer import optimizer
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from shardcheck.megatron.scenarios import scenario

    built, norm = DotProductAttention.__init__, optimizer.get_grad_norm_fp32
    counted = torch.zeros((), dtype=torch.float64)

    def with_attributes(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.softmax_offset.tensor_model_parallel, self.softmax_offset.partition_dim = True, 0

    def recorded(grads, *args, **kwargs):
        counted.copy_(sum(g.double().pow(2).sum() for g in grads))
        return norm(grads, *args, **kwargs)

    if marked:
        DotProductAttention.__init__ = with_attributes
    optimizer.get_grad_norm_fp32 = recorded
    try:
        outputs = scenario("gpt", config=LEARNABLE)(ctx)
    finally:
        DotProductAttention.__init__, optimizer.get_grad_norm_fp32 = built, norm
    dist.all_reduce(counted)
    return {**outputs, "counted": counted}


def _squares(outputs) -> tuple[float, float, float]:
    """The squares Megatron's norm counts, those of every global gradient, and those of tp
    rank 1's offset gradients (heads 2 and 3 of each layer's [layers, heads] row)."""
    grads = {k: v.astype(np.float64) for k, v in outputs.items() if k.startswith("grad/")}
    assert float(outputs["grad_norm"]) ** 2 == pytest.approx(float(outputs["counted"]), rel=1e-6)
    offsets = next(v for k, v in grads.items() if k.endswith("softmax_offset"))
    rank_1 = float((offsets[:, offsets.shape[1] // 2:] ** 2).sum())
    return float(outputs["counted"]), sum(float((v ** 2).sum()) for v in grads.values()), rank_1


def test_megatron_norm_leaves_out_tp_rank_1s_offsets_and_the_attribute_puts_them_back():
    buggy, total, rank_1 = _squares(run_layout(partial(_step, marked=False), Layout(tp=2)))
    fixed, fixed_total, _ = _squares(run_layout(partial(_step, marked=True), Layout(tp=2)))
    assert rank_1 > 1e-7  # about 3e-7 of the norm: below parity's tolerance
    assert total - buggy == pytest.approx(rank_1, rel=1e-6)
    assert fixed == pytest.approx(fixed_total, rel=1e-12)


def _counted_per_tensor(outputs) -> dict[str, tuple[float, float]]:
    """Per global tensor: what the norm counted (of the gradients the step clipped), and the
    square of its clipped global gradient."""
    clipped = float(outputs["clip_factor"]) ** 2
    counted = {k.removeprefix("norm_counted/"): float(v) for k, v in outputs.items() if k.startswith("norm_counted/")}
    return {key: (mass, clipped * float((outputs["grad/" + key].astype(np.float64) ** 2).sum()))
            for key, mass in counted.items()}


def test_what_the_norm_counts_per_tensor_is_each_whole_gradient_but_the_offsets_share():
    buggy = _counted_per_tensor(run_layout(partial(_step, marked=False), Layout(tp=2)))
    fixed = _counted_per_tensor(run_layout(partial(_step, marked=True), Layout(tp=2)))
    assert len(fixed) == len(buggy) > 10
    for key, (counted, whole) in fixed.items():
        assert counted == pytest.approx(whole, rel=1e-5), key
    short = [key for key, (counted, whole) in buggy.items() if counted < whole * (1 - 1e-3)]
    assert [key.rsplit(".", 1)[-1] for key in short] == ["softmax_offset"]


def test_the_checker_reports_the_offset_counted_as_a_replica_and_parity_confirms_it():
    with pools() as warm:
        result = audit([Case("gpt", tuple(LEARNABLE.items()), Layout(tp=2))], run_pools=warm)
    assert not result.errors, [o.error for o in result.errors]
    [finding] = result.findings
    assert finding.kind == "type+numeric"
    [effect] = finding.effect
    assert effect["value"].startswith("norm_counted/") and effect["value"].endswith("softmax_offset")
    assert effect["observed"] < effect["reference"] * 0.9
    assert finding.checker.startswith("checker: shard counted as replica at megatron/core/optimizer/")
    assert "in param_is_not_tensor_parallel_duplicate: {tp:S(0)}" in finding.checker
