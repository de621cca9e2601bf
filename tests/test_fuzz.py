"""The fuzzer finds and shrinks each planted bug, deterministically under a fixed seed."""

import functools
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import strategies as st
from planted import bugs, targets

from shardcheck import R
from shardcheck.cli import main
from shardcheck.fuzz.campaign import FuzzError, fuzz, register_fuzz_target, resolve_target
from shardcheck.fuzz.findings import FindingStore
from shardcheck.fuzz.spaces import (
    per_rank,
    space,
)

SHRUNK = {
    "planted-masked-mean": ("dp2", {"seq_len": 2, "padding": [0, 1]}),
    "planted-smoothed-ce": ("tp2", {"tokens": 1, "vocab": 2, "label_smoothing": 0.1}),
    "planted-token-mean": ("dp2", {"tokens_per_rank": [1, 1], "use_mask": True}),
    "planted-sequence-sum": ("cp2", {"seq_len": 1, "hidden": 1}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHRUNK))
def test_planted_bug_is_found_and_shrunk_exactly(name):
    [finding] = targets.campaign(name).findings
    assert (finding.layout, finding.config) == SHRUNK[name]
    assert finding.observed != finding.reference
    assert finding.corrected == finding.reference  # the fix control agrees with the reference
    assert finding.max_error > 1e-3


def test_checker_locates_the_planted_bug_it_can_type():
    [finding] = targets.campaign("planted-masked-mean").findings
    source = Path(bugs.__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "BUG: each rank's own token count" in text)
    assert finding.location == f"{bugs.__file__}:{line}" and finding.kind == "numeric+type"
    assert finding.checker.startswith(f"checker: division by partial at {bugs.__file__}:{line} in ")
    assert finding.contract == "checker rule 'division by partial'"


def masked_mean_fixed(ctx, seq_len=1, padding=(0,)):
    return targets.masked_mean(ctx, seq_len, padding, fixed=True)


def test_fixed_variant_gives_no_finding():
    strategy = resolve_target("planted-masked-mean").strategy
    fixed = register_fuzz_target("test-masked-mean-fixed", masked_mean_fixed, strategy)
    campaign = fuzz(fixed, budget=12, seed=0, root=None)
    assert campaign.findings == [] and campaign.examples == 12


def two_bugs(ctx, seq_len=1, padding=(0,)):
    group = ctx.groups["dp"]
    return {"mean": targets.masked_mean_run(group, seq_len, list(padding)),
            "sum": targets.sequence_sum_run(group, seq_len, 1)}


TWO_BUGS_SPACE = space(["dp2", "dp3"], seq_len=st.integers(1, 4),
                       padding=per_rank("dp", lambda layout, drawn: st.integers(0, drawn["seq_len"] - 1)))


def test_distinct_failures_are_each_shrunk_and_deduplicated(tmp_path):
    target = register_fuzz_target("test-two-bugs", two_bugs, TWO_BUGS_SPACE, typecheck=False)
    first = fuzz(target, budget=40, seed=1, root=tmp_path)
    triggers = sorted((f.contract, f.layout, f.config) for f in first.findings)
    assert triggers == [
        ("output mean matches the one-rank reference", "dp2", {"seq_len": 2, "padding": [0, 1]}),
        ("output sum matches the one-rank reference", "dp2", {"seq_len": 1, "padding": [0, 0]}),
    ]
    assert sorted(first.new) == sorted(f.id for f in first.findings)
    again = fuzz(target, budget=40, seed=1, root=tmp_path)
    assert again.new == [] and len(FindingStore(tmp_path).all()) == 2


def test_rerun_replays_the_known_failure_first(tmp_path):
    first = fuzz("planted-smoothed-ce", budget=30, seed=0, root=tmp_path)
    again = fuzz("planted-smoothed-ce", budget=30, seed=0, root=tmp_path)
    assert first.first_failure_at > 1 and again.first_failure_at == 1
    assert [f.config for f in again.findings] == [f.config for f in first.findings]
    assert (tmp_path / "hypothesis" / "planted-smoothed-ce").is_dir()


@pytest.mark.parametrize("spec, message", [
    ("no-such-component", "unknown fuzz target 'no-such-component'"),
    ("no_such_module:f", "cannot import 'no_such_module'"),
    ("planted.targets:no_such_function", "has no function 'no_such_function'"),
])
def test_bad_targets_raise_one_clear_error(spec, message):
    with pytest.raises(FuzzError, match=message):
        resolve_target(spec)


def test_cli_fuzz_reports_and_stores_the_finding(tmp_path):
    result = CliRunner().invoke(main, ["fuzz", "planted.targets:sequence_sum", "--seed", "0",
                                       "--budget", "20", "--root", str(tmp_path)])
    assert result.exit_code == 1, result.output
    [finding] = FindingStore(tmp_path).all()
    assert finding.target == "planted-sequence-sum" and finding.config == {"seq_len": 1, "hidden": 1}
    assert finding.id in result.output and "1 finding(s), 1 new" in result.output
    listed = CliRunner().invoke(main, ["findings", "--no-run", "--root", str(tmp_path)])
    assert listed.exit_code == 0 and finding.id in listed.output


def test_cli_bad_target_is_one_line_without_traceback():
    result = CliRunner().invoke(main, ["fuzz", "nowhere:nothing"])
    assert result.exit_code == 2
    assert result.output.strip() == ("Error: cannot import 'nowhere' for scenario 'nowhere:nothing': "
                                     "No module named 'nowhere'")


def unregistered_sum(ctx, seq_len=2, hidden=1):
    """A user's scenario that registers nothing: its keyword defaults give the search space."""
    return {"sum": targets.sequence_sum_run(ctx.groups["world"], seq_len, hidden)}


def test_unregistered_user_scenario_is_fuzzed_from_its_signature():
    target = resolve_target("test_fuzz:unregistered_sum", typecheck=False)
    [finding] = fuzz(target, budget=20, seed=0, root=None).findings
    assert (finding.layout, finding.config) == ("tp2", {"seq_len": 1, "hidden": 1})
    assert finding.target == "test_fuzz:unregistered_sum"


def crashes_on_big_inputs(ctx, size=1):
    if size > 2 and ctx.layout.world_size > 1:
        raise ValueError(f"size {size} is too big")
    return {"value": ctx.declare(torch.ones(1) * size, **{"tp": R})}


def test_a_raising_rank_is_a_run_finding_at_the_raise():
    target = register_fuzz_target("test-crash", crashes_on_big_inputs,
                                  space(["tp2"], size=st.integers(1, 5)), typecheck=False)
    [finding] = fuzz(target, budget=20, seed=0, root=None).findings
    line = crashes_on_big_inputs.__code__.co_firstlineno + 2
    assert (finding.kind, finding.config, finding.contract) == ("run", {"size": 3}, "runs without raising")
    assert finding.location == f"{__file__}:{line}"
    assert "ValueError: size 3 is too big" in finding.title


def planted_masked_mean(**config):
    """A scenario factory, as the Megatron catalogue registers its components."""
    return functools.partial(targets.masked_mean, **config)


def test_make_scenario_targets_run_through_the_pool():
    strategy = resolve_target("planted-masked-mean").strategy
    target = register_fuzz_target("test-factory", make_scenario=planted_masked_mean, strategy=strategy)
    [finding] = fuzz(target, budget=30, seed=0, root=None).findings
    assert (finding.layout, finding.config) == SHRUNK["planted-masked-mean"]
    assert finding.observed == {"value": 2.25} and finding.reference == {"value": 2.0}
