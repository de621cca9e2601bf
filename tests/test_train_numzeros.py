"""The num-zeros report's question on a CPU (issue 32): "is this shift real, and does it survive
a resume?"

One run of Megatron's functional test ``moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer``
(the repository carries its ``model_config.yaml``) through ``--model-config`` with repeats, a
resume from Megatron's torch_dist checkpoint and ``--out``: MoE at EP2 with the distributed
optimizer. The resumed run continues bit for bit (megatron-core's torch-Adam step handling and
its float32 optimizer load are worked around in the CPU layer), and ``golden check``,
``compare`` (with the repeats) and ``explain`` (with the tokens per expert) read what it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_train import BASE  # noqa: F401 - skips this module where test_train is skipped (megatron-core < 0.19)

from shardcheck.cli import main
from shardcheck.golden import load_golden, load_model_config
from shardcheck.golden.io import load_expert_tokens

pytestmark = pytest.mark.timeout(900)

EP8 = (Path(__file__).parent / "data" / "megatron-golden" / "head" / "moe"
       / "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer" / "model_config.yaml")
STEPS = 4  # the step after the resumed one shows its optimizer update: step 4's loss reads step 3's


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job's output and its --out folder."""
    out = tmp_path_factory.mktemp("numzeros")
    result = CliRunner().invoke(main, ["train", "--model-config", str(EP8), "--steps", str(STEPS),
                                       "--repeats", "2", "--resume-at", "2", "--out", str(out)])
    return result, out


def test_resume_at_a_step_continues_exactly_as_the_uninterrupted_run(job):
    """With the distributed optimizer: each parameter's Adam step comes back as the checkpoint's
    (megatron-core left it at 0 on torch's Adam, shared by all), and its float32 load runs."""
    result, _ = job
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "verdict: AGREE" in lines
    resumed = lines[lines.index(next(ln for ln in lines if ln.startswith("resumed at step 2"))):]
    assert resumed[1].startswith(f"  compared {STEPS} steps: lm loss max rel diff 0, grad norm max rel diff 0")
    assert resumed[-1] == "  verdict: AGREE"
    assert not any(ln.startswith("  note: within tolerance, but not bit for bit") for ln in resumed)


def test_out_holds_the_repeats_the_resumed_run_and_tokens_per_expert_as_a_resume_test(job):
    _, out = job
    for name in ("2ranks", "1rank", "2ranks_repeat1", "1rank_repeat1"):
        golden = load_golden(out / f"golden_values_{name}.json")
        assert list(golden.metrics["num-zeros"].steps) == list(range(1, STEPS + 1))
        assert set(load_expert_tokens(out / f"golden_values_{name}.json")) == set(range(1, STEPS + 1))
    second = out / "golden_values_2ranks_2nd.json"  # as a functional resume test stores its second run
    assert list(load_golden(second).metrics["lm loss"].steps) == [3, 4]
    assert set(load_expert_tokens(second)) == {3, 4}
    config = load_model_config(out / "model_config.yaml")
    assert config.test_type == "ckpt-resume" and config.arg_int("--save-interval") == 2
    assert config.arg_flag("--use-distributed-optimizer") and config.arg_int("--num-experts") == 4


def _golden(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["golden", *map(str, args)])
    return result.exit_code, result.output


def test_golden_check_compare_and_explain_read_what_it_wrote(job):
    _, out = job
    first, second, config = out / "golden_values_2ranks.json", out / "golden_values_2ranks_2nd.json", out / "model_config.yaml"
    code, text = _golden("check", first, first, "--second-run", second, "--model-config", config)
    assert code == 0, text  # the resume step is the config's save interval; the exact checks pass
    assert "resume: second run vs first run after step 2" in text
    assert "  PASS num-zeros deterministic (rtol 0): 0 of 2 step(s) off" in text

    code, text = _golden("compare", out / "golden_values_1rank.json", first,
                         "--old-repeats", out / "golden_values_1rank_repeat1.json",
                         "--new-repeats", out / "golden_values_2ranks_repeat1.json", "--json")
    assert code == 0, text
    report = json.loads(text)
    metrics = {m["metric"]: m for m in report["files"][0]["metrics"]}
    assert metrics["lm loss"]["pattern"] == "unchanged"  # one rank and EP2 agree
    assert metrics["num-zeros"]["pattern"] == "zero in both"  # 256 tokens, top-2 of 4 experts: none idle
    noise = {v["metric"]: v for v in report["noise"]}
    assert (noise["lm loss"]["old_runs"], noise["lm loss"]["new_runs"], noise["lm loss"]["steps"]) == (2, 2, STEPS)

    code, text = _golden("explain", first, second, "--model-config", config, "--json")
    assert code == 0, text
    explained = json.loads(text)
    assert explained["block"]["name"] == "one expert (fc1 + fc2)"  # the tokens say: one expert a block
    assert explained["idle_experts"] == [] and explained["steps"] == []  # no expert idle, no block
