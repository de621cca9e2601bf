"""num-zeros jumps as whole experts, on the real EP8 H100 files."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from golden_data import A2A, EP8, TOP2, head, history, plain_series

from shardcheck.cli import main
from shardcheck.golden import report
from shardcheck.golden.config import load_model_config, parse_model_config
from shardcheck.golden.explain import ONE_EXPERT, candidate_blocks, explain_num_zeros
from shardcheck.golden.io import (
    GoldenInputError,
    MetricSeries,
    load_expert_tokens,
    load_golden,
    tokens_path,
)

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


TRAIN_MOE = Path(__file__).parent / "data" / "train_moe"


def explain_train(old: Path, new: Path):
    return explain_num_zeros(load_golden(old).metrics["num-zeros"], load_golden(new).metrics["num-zeros"],
                             load_model_config(TRAIN_MOE / "model_config.yaml"),
                             load_expert_tokens(old), load_expert_tokens(new))


def idle_by_hand(path: Path) -> dict[int, int]:
    tokens = json.loads(tokens_path(path).read_text())
    return {int(step): sum(n == 0 for counts in routers.values() for n in counts)
            for step, routers in tokens.items()}


def test_train_runs_num_zeros_change_is_the_experts_that_received_no_tokens():
    old, new = TRAIN_MOE / "golden_values_1rank.json", TRAIN_MOE / "golden_values_1rank_repeat1.json"
    explained = explain_train(old, new)
    assert explained.block.name == ONE_EXPERT and explained.block.size == 64 * 256 + 256 * 64
    assert explained.changed()  # the two seeds' num-zeros differ
    assert {s.step: (s.old_blocks, s.new_blocks) for s in explained.steps} == {
        step: (idle_by_hand(old)[step], idle_by_hand(new)[step]) for step in (1, 2, 3)}
    assert explained.unexplained_by_idle_experts() == []
    first = explained.idle[0]
    assert first.step == 1 and first.new == {"decoder.layers.0.mlp.router": (1, 3)}


def test_idle_experts_that_do_not_match_the_counts_are_named(tmp_path):
    """The same pair with one idle expert of NEW given tokens: step 1's two blocks are no longer
    its idle experts."""
    new = tmp_path / "new.json"
    shutil.copy(TRAIN_MOE / "golden_values_1rank_repeat1.json", new)
    tokens = json.loads(tokens_path(TRAIN_MOE / "golden_values_1rank_repeat1.json").read_text())
    tokens["1"]["decoder.layers.0.mlp.router"][3] = 2
    tokens_path(new).write_text(json.dumps(tokens))
    explained = explain_train(TRAIN_MOE / "golden_values_1rank.json", new)
    assert [s.step for s in explained.unexplained_by_idle_experts()] == [1]
    lines = report.explanation_lines(explained)
    assert lines[-1] == "whole blocks differ from the idle experts at step(s) 1 (4/2 blocks)"


def test_golden_explain_prints_the_idle_experts_of_a_train_run():
    result = CliRunner().invoke(main, ["golden", "explain", str(TRAIN_MOE / "golden_values_2ranks.json"),
                                       str(TRAIN_MOE / "golden_values_1rank.json"),
                                       "--model-config", str(TRAIN_MOE / "model_config.yaml")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "steps that gained or lost whole blocks: none" in lines  # the EP2 run and its one-rank run
    assert "  step 1: old decoder.layers.0.mlp.router [1], decoder.layers.1.mlp.router [0, 4, 6]; new " \
           "decoder.layers.0.mlp.router [1], decoder.layers.1.mlp.router [0, 4, 6]" in lines
    assert lines[-1] == "whole blocks are the idle experts at every step"


def test_ci_files_without_tokens_per_expert_explain_as_before():
    assert explain_pair("golden_values_dev_dgx_h100.json", "golden_values_dev_dgx_h100_2nd.json").idle is None


def test_a_step_whose_old_count_is_zero_is_split_too():
    """A float32 run's num-zeros is 0 where no expert went idle; a step going from 0 to one
    expert gained a block (Megatron's relative statistic skips old zeros; explain must not)."""
    config = parse_model_config(
        "MODEL_ARGS:\n  --hidden-size: 64\n  --moe-ffn-hidden-size: 64\n  --num-experts: 8\n", "cfg")
    steps, plain = np.array([1, 2, 3, 4]), np.zeros(4, bool)
    old = MetricSeries("num-zeros", steps, np.array([0.0, 0.0, 0.0, 8192.0]), plain)
    new = MetricSeries("num-zeros", steps, np.array([8192.0, 0.0, 0.0, 8192.0]), plain)
    got = explain_num_zeros(old, new, config)
    assert got.block is not None and got.block.size == 8192
    assert [(s.step, s.old_blocks, s.new_blocks) for s in got.changed()] == [(1, 0, 1)]
    assert len(got.steps) == 4
