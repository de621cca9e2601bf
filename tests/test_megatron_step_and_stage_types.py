"""Real megatron-core under the checker: options that used to give type-only false positives
(``deterministic_mode``'s ``weight[indices]`` lookup under tp2, a GLU under pp2) are clean,
and the gradient check at ``optimizer.step`` follows ``main_grad`` through DDP's buffer
all-reduce: clean on the correct run, flagged when the all-reduce is skipped; weights that
Megatron leaves without tensor-parallel attributes are flagged where the gradient norm counts
only one rank's piece; the vocab-parallel embedding's and GLU's fused fc1's gradients fit their
tp cut (query-key layer scaling and GLU under tp used to be false alarms at the step)."""

import pytest

pytest.importorskip("megatron.core")

from megatron_release import fixed_in  # noqa: E402

from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD, pools  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.parity.launch import spawn_ranks  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.megatron]
for module in PRELOAD:
    __import__(module)


def test_deterministic_lookup_under_tp2_and_glu_under_pp2_give_no_finding():
    """With query-key layer scaling the backward is typed back to the embedding, so the
    ``weight[indices]`` lookup's gradient reaches the step typed (it used to come out R)."""
    cases = [Case("gpt", (("deterministic_mode", True),), Layout(tp=2)),
             Case("gpt", (("deterministic_mode", True), ("apply_query_key_layer_scaling", True)),
                  Layout(tp=2)),
             Case("gpt", (("gated_linear_unit", True),), Layout(pp=2))]
    with pools() as warm:
        result = audit(cases, run_pools=warm)
    assert not result.errors, [o.error for o in result.errors]
    assert len(result.outcomes) == 3 and result.findings == []


@fixed_in("0.19", "weights built without perform_initialization get no tensor_model_parallel")
def test_weights_left_without_tp_attributes_are_flagged_where_the_grad_norm_skips_them():
    """Without ``perform_initialization`` the parallel linear weights lack
    ``tensor_model_parallel``: typed by their checkpoint cut, they are S(0) on tp, and the
    gradient norm's duplicate test keeps only tp rank 0's piece. Initialised: no finding."""
    cases = [Case("gpt", (("perform_initialization", False),), Layout(tp=2)),
             Case("gpt", (), Layout(tp=2))]
    with pools() as warm:
        result = audit(cases, run_pools=warm)
    assert not result.errors, [o.error for o in result.errors]
    (finding,) = result.findings
    assert finding.trigger["options"] == {"perform_initialization": False}
    # located where the weight is built without its mark (the norm, clip_grads.py:51, shows it)
    assert finding.kind == "type+numeric" and finding.location == "megatron/core/tensor_parallel/layers.py:239"
    assert finding.checker.startswith("checker: shard counted as replica at megatron/core/optimizer/")
    assert "param_is_not_tensor_parallel_duplicate: {tp:S(0)}" in finding.checker


def _step_violations(layout: Layout, skip_dp_all_reduce: bool, config: dict | None = None) -> list[str]:
    """One GPT training step in the checker; the violations located in megatron-core."""
    import torch.distributed as dist

    from shardcheck.megatron.checks import contracts
    from shardcheck.megatron.checks.typecheck import checked_region
    from shardcheck.megatron.cpu.runner import RankContext
    from shardcheck.megatron.scenarios import scenario
    from shardcheck.parity.scenario import build_groups

    if skip_dp_all_reduce:
        _skip_bucket_all_reduce()
    contracts.install()
    ctx = RankContext(layout, dist.get_rank(), build_groups(layout, dist.get_rank()))
    with checked_region(ctx) as found:
        scenario("gpt", config=config or {})(ctx)
    return [v["line"] for v in found]


def _skip_bucket_all_reduce() -> None:
    """The planted bug: DDP scales its gradient buckets but never all-reduces them."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    def scale_only(self, force_all_reduce=False):
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor

    _ParamAndGradBucketGroup.start_grad_sync = scale_only


@pytest.mark.parametrize("layout", ["dp2", "cp2"])
def test_gradient_check_at_the_step_follows_main_grad_through_ddp(layout):
    correct = spawn_ranks(_step_violations, 2, Layout.parse(layout), False)
    planted = spawn_ranks(_step_violations, 2, Layout.parse(layout), True)
    axis = layout[:2]
    for clean, flagged in zip(correct, planted, strict=True):
        assert not [line for line in clean if "gradient" in line]
        unreduced = [line for line in flagged if line.startswith("checker: unreduced gradient")]
        assert len(unreduced) >= 10, flagged  # of 29: the others' gradients are still untyped
        assert all(f"parameter R on {axis}, gradient V" in line and "optimizer" in line
                   for line in unreduced)


def test_embedding_and_glu_gradients_fit_their_tp_cut_and_stay_unreduced_when_dp_skips():
    """Under tp2-dp2, query-key layer scaling (which types the path back to the vocab-parallel
    embedding) and a GLU (whose fc1 holds gate and up in sections) used to make their tp-cut
    weights' gradients R and V at the step. Correct: no finding. With DDP's all-reduce skipped,
    every gradient is unreduced over dp, these included, and none breaks its tp cut."""
    config = {"apply_query_key_layer_scaling": True, "gated_linear_unit": True}
    layout = Layout.parse("tp2-dp2")
    correct = spawn_ranks(_step_violations, 4, layout, False, config)
    planted = spawn_ranks(_step_violations, 4, layout, True, config)
    for clean, flagged in zip(correct, planted, strict=True):
        assert clean == []
        assert not [line for line in flagged if "on tp" in line], flagged
        unreduced = [line for line in flagged if line.startswith("checker: unreduced gradient")]
        for weight in ("embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                       "decoder.layers.1.mlp.linear_fc1.weight"):
            assert any(f"{weight}: parameter R on dp, gradient V" in line for line in unreduced)
