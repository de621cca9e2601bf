"""T5 cross attention and LLaVA's multimodal embedding path on Gloo ranks match one rank.

Each layout runs the real megatron-core model through a warm rank pool; planted rank-dependent
mistakes in the same paths (a lost encoder-decoder mask, image embeddings put in the wrong
places) show that the comparison sees them, and one real 0.16.1 crash (the affine vision
projection under tp) is pinned down.
"""

import numpy as np
import pytest

pytest.importorskip("megatron.core")

import megatron.core.pipeline_parallel.schedules  # noqa: E402, F401  (imported once, before forking)

from shardcheck.megatron.cpu.parallel import LayoutUnsupported  # noqa: E402
from shardcheck.megatron.cpu.runner import relative_errors, worst  # noqa: E402
from shardcheck.megatron.scenarios import (  # noqa: E402
    COMPONENTS,
    PRESETS,
    multimodal,
    preset,
    scenario,
    t5,
)
from shardcheck.parity.layout import Layout  # noqa: E402
from shardcheck.parity.pool import PoolFailure, RankPool  # noqa: E402

pytestmark = pytest.mark.slow
ONE = Layout()
TP2, TP2_SP, DP2 = Layout(tp=2), Layout(tp=2, sp=True), Layout(dp=2)
TP2_DP2_SP = Layout(tp=2, dp=2, sp=True)


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, timeout=300) as ranks:
        yield ranks


def _global_outputs(ctx, run) -> dict[str, np.ndarray]:
    return {name: value.detach().double().numpy() for name, value in run(ctx).items()}


def _outputs(pool, run, layout: Layout) -> list[dict[str, np.ndarray]]:
    return pool.run(layout, _global_outputs, run)


def _replicated(per_rank: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    for outputs in per_rank[1:]:
        for name, value in outputs.items():
            assert np.allclose(value, per_rank[0][name], rtol=1e-6, atol=1e-9), name
    return per_rank[0]


def _errors(pool, run, layout: Layout, reference) -> dict[str, float]:
    return relative_errors(_replicated(_outputs(pool, run, layout)), reference)


def _matches_everywhere(pool, run, layouts) -> dict[str, np.ndarray]:
    reference = _outputs(pool, run, ONE)[0]
    for layout in layouts:
        errors = _errors(pool, run, layout, reference)
        assert worst(errors)[1] <= 1e-5, (layout, worst(errors))
    return reference


# ---- T5 -----------------------------------------------------------------------------------

def test_t5_cross_attention_matches_one_rank_under_tp_sp_and_dp(pool):
    reference = _matches_everywhere(pool, scenario("t5"), [TP2, TP2_SP, DP2, TP2_DP2_SP])
    assert any(k.startswith("grad/decoder.layers.cross_attention.linear_kv") for k in reference)
    assert reference["encoder_output"].shape == (2, 8, 2, 16)  # [microbatch, seq, batch, hidden]


def test_t5_with_encoder_padding_matches_one_rank_and_the_mask_matters(pool):
    padded = scenario("t5", encoder_padding=True, loss_mask=True)
    reference = _matches_everywhere(pool, padded, [TP2_SP, DP2])
    unpadded = _outputs(pool, scenario("t5", loss_mask=True), ONE)[0]
    assert abs(reference["loss"] - unpadded["loss"]) > 1e-4


def _t5_cross_mask_lost_on_tp_rank_1(ctx):
    """Planted: tensor-parallel rank 1 runs cross attention without the encoder-decoder mask."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.attention import CrossAttention

    original = CrossAttention.forward

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if ps.get_tensor_model_parallel_rank() == 1:
            attention_mask = None
        return original(self, hidden_states, attention_mask, **kwargs)

    CrossAttention.forward = forward
    try:
        return scenario("t5", encoder_padding=True)(ctx)
    finally:
        CrossAttention.forward = original


def test_a_cross_attention_mask_lost_on_one_rank_is_seen(pool):
    reference = _outputs(pool, scenario("t5", encoder_padding=True), ONE)[0]
    planted = _outputs(pool, _t5_cross_mask_lost_on_tp_rank_1, TP2)[0]
    errors = relative_errors(planted, reference)
    assert errors["loss"] > 1e-5  # rounding is ~1e-7
    assert worst(errors, "grad/decoder.layers.cross_attention")[1] > 1e-3
    assert errors["encoder_output"] < 1e-6  # the encoder is untouched: the divergence is located


# ---- LLaVA --------------------------------------------------------------------------------

def test_llava_embedding_path_matches_one_rank_under_tp_sp_and_dp(pool):
    reference = _matches_everywhere(pool, scenario("multimodal"), [TP2, TP2_SP, DP2, TP2_DP2_SP])
    assert any(k.startswith("grad/vision_projection") for k in reference)
    assert any(k.startswith("grad/vision_model.decoder") for k in reference)
    assert reference["combined_embeddings"].shape == (2, 12, 2, 16)


def test_llava_with_a_text_only_sample_matches_one_rank_under_sp(pool):
    reference = _matches_everywhere(pool, scenario("multimodal", text_only_sample=True,
                                                   loss_mask=True), [TP2_SP])
    # the text-only sample is padded after its text: zero embeddings there
    assert not reference["combined_embeddings"][:, -3:, 1].any()


def test_llava_with_pixel_shuffle_keeps_the_combined_length_and_matches_one_rank_under_sp(pool):
    """pixel_shuffle folds each 2x2 of patches into one embedding: the text is sized for the
    shorter image, so the combined sequence needs no padding for sequence parallelism."""
    shuffled = scenario("multimodal", model_args={"pixel_shuffle": True})
    reference = _matches_everywhere(pool, shuffled, [TP2_SP])
    assert reference["combined_embeddings"].shape == (2, 12, 2, 16)


def _llava_images_swapped_on_tp_rank_1(ctx):
    """Planted: tensor-parallel rank 1 puts each sample's image into the other sample.

    (Reversing the embeddings within an image would change nothing: image positions carry no
    position embedding and no loss, so the one-layer model sees each image as a set.)"""
    from megatron.core import parallel_state as ps
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    original = LLaVAModel._preprocess_data

    def preprocess(self, image_embeddings, *args, **kwargs):
        if ps.get_tensor_model_parallel_rank() == 1:
            image_embeddings = image_embeddings.flip(1)  # [img_seq, image, h]
        return original(self, image_embeddings, *args, **kwargs)

    LLaVAModel._preprocess_data = preprocess
    try:
        return scenario("multimodal")(ctx)
    finally:
        LLaVAModel._preprocess_data = original


def test_image_embeddings_misplaced_on_one_rank_are_seen(pool):
    reference = _outputs(pool, scenario("multimodal"), ONE)[0]
    planted = _outputs(pool, _llava_images_swapped_on_tp_rank_1, TP2)[0]
    errors = relative_errors(planted, reference)
    assert errors["loss"] > 1e-6  # rounding is ~1e-7
    assert worst(errors, "grad/language_model")[1] > 1e-3


def test_affine_vision_projection_with_bias_crashes_under_tp(pool):
    """0.16.1: MultimodalProjector's affine ColumnParallelLinear gathers its output but returns
    its bias unreduced (skip_bias_add), so output + bias fails under tp > 1."""
    affine = scenario("multimodal", projection="affine")
    assert np.isfinite(_outputs(pool, affine, ONE)[0]["loss"])
    with pytest.raises(PoolFailure, match="must match the size of tensor b"):
        _outputs(pool, affine, TP2)


# ---- layouts refused ----------------------------------------------------------------------

@pytest.mark.parametrize("component", ["t5", "multimodal"])
@pytest.mark.parametrize("layout", [Layout(pp=2), Layout(cp=2), Layout(tp=2, cp=2)], ids=str)
def test_unsupported_layouts_are_refused_with_a_reason(component, layout):
    module = {"t5": t5, "multimodal": multimodal}[component]
    with pytest.raises(LayoutUnsupported, match="pipeline|context"):
        module.check_layout(layout)
    assert "parallel" in COMPONENTS[component].refuses(layout)  # the audit skips it up front
    assert COMPONENTS[component].refuses(TP2_DP2_SP) is None


def test_presets_name_valid_options():
    names = [name for name in PRESETS if name.startswith(("t5/", "multimodal/"))]
    assert len(names) == 6
    for name in names:
        assert callable(preset(name))
