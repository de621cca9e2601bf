"""The fuzzer finds and shrinks each planted bug, deterministically under a fixed seed."""

import pytest
from click.testing import CliRunner
from hypothesis import find
from hypothesis import strategies as st
from planted import targets

from shardcheck.cli import main
from shardcheck.findings import FindingStore
from shardcheck.fuzz import (
    FuzzError,
    fuzz,
    layouts,
    option,
    per_rank,
    register_fuzz_target,
    resolve_target,
    signature_space,
    space,
)
from shardcheck.layout import Layout

SHRUNK = {
    "planted-masked-mean": ("dp2", {"seq_len": 2, "padding": [0, 1]}),
    "planted-smoothed-ce": ("tp2", {"tokens": 1, "vocab": 2, "label_smoothing": 0.1}),
    "planted-token-mean": ("dp2", {"tokens_per_rank": [1, 1], "use_mask": True}),
    "planted-sequence-sum": ("cp2", {"seq_len": 1, "hidden": 1}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHRUNK))
def test_planted_bug_is_found_and_shrunk_exactly(name):
    campaign = fuzz(name, budget=30, seed=0, root=None)
    [finding] = campaign.findings
    assert (finding.layout, finding.config) == SHRUNK[name]
    assert finding.observed != finding.reference
    assert finding.corrected == finding.reference  # the fix control agrees with the reference
    assert finding.max_error > 1e-3


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


@pytest.mark.slow
def test_distinct_failures_are_each_shrunk_and_deduplicated(tmp_path):
    target = register_fuzz_target("test-two-bugs", two_bugs, TWO_BUGS_SPACE)
    first = fuzz(target, budget=40, seed=1, root=tmp_path)
    triggers = sorted((f.contract, f.layout, f.config) for f in first.findings)
    assert triggers == [
        ("output 'mean' equals the one-rank reference", "dp2", {"seq_len": 2, "padding": [0, 1]}),
        ("output 'sum' equals the one-rank reference", "dp2", {"seq_len": 1, "padding": [0, 0]}),
    ]
    assert sorted(first.new) == sorted(f.id for f in first.findings)
    again = fuzz(target, budget=40, seed=1, root=tmp_path)
    assert again.new == [] and len(FindingStore(tmp_path).all()) == 2
    assert again.first_failure_at == 1  # the example database replays a known failure first


def test_layouts_shrink_to_fewest_ranks_and_options_to_default():
    assert find(layouts(["tp2-dp2", "dp2", "tp4"]), lambda _: True) == "dp2"
    assert find(option(0.0, 0.1, 0.2), lambda _: True) == 0.0
    assert find(option(0.0, 0.1, 0.2), lambda x: x > 0) == 0.1


def test_per_rank_fields_have_one_value_per_rank():
    example = find(space(["dp3"], tokens=per_rank("dp", st.integers(1, 4))), lambda _: True)
    assert example == {"layout": "dp3", "tokens": [1, 1, 1]}


def test_signature_space_varies_keyword_defaults():
    def scenario(ctx, sizes=3, smoothing=0.0, masked=False, name="x"):
        return {}

    example = find(signature_space(scenario, ["tp2"]), lambda e: e["masked"] and e["sizes"] != 3)
    assert example == {"layout": "tp2", "sizes": 1, "smoothing": 0.0, "masked": True}
    assert Layout.parse(example["layout"]).world_size == 2


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
    assert result.exit_code == 1
    assert result.output.strip() == ("Error: cannot import 'nowhere' for scenario 'nowhere:nothing': "
                                     "No module named 'nowhere'")


def unregistered_sum(ctx, seq_len=2, hidden=1):
    """A user's scenario that registers nothing: its keyword defaults give the search space."""
    return {"sum": targets.sequence_sum_run(ctx.groups["world"], seq_len, hidden)}


def test_unregistered_user_scenario_is_fuzzed_from_its_signature():
    [finding] = fuzz("test_fuzz:unregistered_sum", budget=20, seed=0, root=None).findings
    assert (finding.layout, finding.config) == ("tp2", {"seq_len": 1, "hidden": 1})
    assert finding.target == "test_fuzz:unregistered_sum"
