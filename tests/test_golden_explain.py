"""num-zeros jumps as whole experts, on the real EP8 H100 files."""

import pytest
from golden_data import A2A, EP8, TOP2, head, history, plain_series

from shardcheck.golden.config import load_model_config, parse_model_config
from shardcheck.golden.explain import candidate_blocks, explain_num_zeros
from shardcheck.golden.io import GoldenInputError, load_golden

EXPERT = 512 * 1024 + 1024 * 512  # fc1 (hidden x moe-ffn) + fc2 (moe-ffn x hidden), no GLU


def explain_pair(old_name, new_name, case=EP8):
    old = load_golden(head(f"{case}/{old_name}")).metrics["num-zeros"]
    new = load_golden(head(f"{case}/{new_name}")).metrics["num-zeros"]
    return explain_num_zeros(old, new, load_model_config(head(f"{case}/model_config.yaml")))


def test_ep8_config_gives_the_expert_block():
    blocks = candidate_blocks(load_model_config(head(f"{EP8}/model_config.yaml")))
    assert blocks[0].size == EXPERT == 1_048_576
    assert blocks[0].formula == "512x1024 + 1024x512"


def test_ep8_h100_counts_are_whole_experts_plus_a_small_residual():
    values = plain_series(head(f"{EP8}/golden_values_dev_dgx_h100.json"), "num-zeros")
    by_hand = {s: int(v // EXPERT) for s, v in values.items() if v >= EXPERT}
    assert set(by_hand.values()) == {1, 2}
    assert all(values[s] - k * EXPERT < 0.06 * EXPERT for s, k in by_hand.items())
    explained = explain_pair(
        "golden_values_dev_dgx_h100.json", "golden_values_dev_dgx_h100_2nd.json"
    )
    assert explained.block.size == EXPERT
    shared = {s.step: s.old_blocks for s in explained.steps}
    assert {s: k for s, k in shared.items() if k} == {
        s: k for s, k in by_hand.items() if s in shared
    }


def test_resumed_run_gains_an_idle_expert_at_two_steps():
    first = plain_series(head(f"{EP8}/golden_values_dev_dgx_h100.json"), "num-zeros")
    second = plain_series(head(f"{EP8}/golden_values_dev_dgx_h100_2nd.json"), "num-zeros")
    by_hand = {s: int(second[s] // EXPERT) - int(first[s] // EXPERT) for s in second if s in first}
    by_hand = {s: d for s, d in by_hand.items() if d}
    explained = explain_pair(
        "golden_values_dev_dgx_h100.json", "golden_values_dev_dgx_h100_2nd.json"
    )
    assert (
        {s.step: s.new_blocks - s.old_blocks for s in explained.changed()}
        == by_hand
        == {58: 1, 97: 1}
    )
    residual_old = [first[s] - (first[s] // EXPERT) * EXPERT for s in sorted(second) if s in first]
    assert explained.residual.old_mean == pytest.approx(sum(residual_old) / len(residual_old))


def test_a_baseline_only_shift_has_no_whole_blocks():
    old, new = history(A2A, "build: Bump TE2.13")
    assert plain_series(old, "num-zeros") != plain_series(new, "num-zeros")  # the count moved
    config = load_model_config(head(f"{A2A}/model_config.yaml"))
    explained = explain_num_zeros(
        load_golden(old).metrics["num-zeros"], load_golden(new).metrics["num-zeros"], config
    )
    assert explained.candidates  # the config sizes blocks, and none of them explains the counts
    assert explained.block is None and explained.steps == () and explained.residual is None


def test_swiglu_doubles_fc1_and_etp_adds_a_shard_block():
    text = (
        "MODEL_ARGS:\n  --hidden-size: 256\n  --moe-ffn-hidden-size: 128\n  --num-experts: 4\n"
        "  --swiglu: true\n  --tensor-model-parallel-size: 2\n  --expert-model-parallel-size: 2\n"
    )
    blocks = {b.name: b.size for b in candidate_blocks(parse_model_config(text, "c"))}
    expert = 256 * 2 * 128 + 128 * 256
    assert blocks["one expert (fc1 + fc2)"] == expert
    assert blocks["expert shard of one ETP rank (1/2)"] == expert // 2  # ETP defaults to TP
    assert blocks["experts of one EP rank (2)"] == 2 * expert


def test_config_without_hidden_size_is_rejected():
    with pytest.raises(GoldenInputError, match="no --hidden-size"):
        candidate_blocks(parse_model_config("MODEL_ARGS:\n  --num-layers: 2\n", "c"))


def test_top2router_runs_disagree_on_which_steps_have_an_idle_expert():
    expert = 512 * 2048 + 2048 * 512  # ffn defaults to 4 x hidden, moe-ffn to ffn
    old = plain_series(head(f"{TOP2}/golden_values_dev_dgx_h100_2nd.json"), "num-zeros")
    new = plain_series(head(f"{TOP2}/golden_values_dev_dgx_h100.json"), "num-zeros")
    deltas = {s: int(new[s] // expert) - int(old[s] // expert) for s in old if s in new}
    explained = explain_pair(
        "golden_values_dev_dgx_h100_2nd.json", "golden_values_dev_dgx_h100.json", TOP2
    )
    assert explained.block.size == expert
    assert {s.step: s.new_blocks - s.old_blocks for s in explained.changed()} == {
        s: d for s, d in deltas.items() if d
    }
    assert sorted(deltas.values()).count(1) == 11 and sorted(deltas.values()).count(-1) == 12
