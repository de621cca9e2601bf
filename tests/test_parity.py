import parity_scenarios as scenarios
import pytest

import shardcheck as sc
from shardcheck.parity.pool import RankPool

LAYOUTS = ["tp2", "tp2-sp", "cp2", "dp2", "tp2-dp2", "tp2-cp2-sp"]


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, timeout=60) as warm:
        yield warm


def test_correct_tp_sp_cp_dp_block_matches_at_tight_tolerances(pool):
    result = sc.parity(scenarios.correct, LAYOUTS, pool=pool)
    assert scenarios.compared_clean(result, LAYOUTS), str(result)
    for report in result.reports:
        assert [r.kind for r in report.rows].count("module") == 7
        assert {r.name for r in report.rows if r.kind == "grad"} == {
            "block.gamma", "block.fc1.weight", "block.fc2.weight"}
        # every value compared (none skipped), rounding-level errors, tolerances far below 1e-3
        assert all(r.verdict == "ok" and r.max_rel < 1e-5 and r.tol < 2e-4 for r in report.rows), str(result)


def test_types_come_from_the_checker_declarations_or_inference(pool):
    report = sc.parity(scenarios.correct, ["tp2-cp2-sp"], pool=pool)["tp2-cp2-sp"]
    assert report.row("module", "block.fc1").types.replace("*", "") == "tp=S(2) cp=S(1)"
    assert report.row("module", "block.norm").types == "tp=S(1) cp=S(1)", "typed by the checker"
    assert report.row("grad", "block.fc1.weight").types.startswith("tp=S(0) ")
    assert report.row("output", "loss").types == "tp=R cp=R"


def test_explicit_groups_expose_code_that_reads_a_default_order_group(pool):
    explicit = sc.Layout(tp=2, dp=2, explicit_groups={"tp": [[0, 2], [1, 3]], "dp": [[0, 1], [2, 3]]})
    assert scenarios.compared_clean(sc.parity(scenarios.correct, [explicit], pool=pool), [explicit])
    result = sc.parity(scenarios.global_group_bug, ["tp2-dp2", explicit], pool=pool)
    assert result["tp2-dp2"].ok and result["tp2-dp2"].rows, "with the default order the two groups coincide"
    assert result[explicit].first_divergence == "block.fc2"


@pytest.mark.parametrize(("scenario", "layout", "module"), [
    (scenarios.count_bug, "cp2", "block.pool"),
    (scenarios.seed_bug, "tp2", "block.drop"),
    (scenarios.seed_bug, "dp2", "block.drop"),
    (scenarios.scale_bug, "tp2", "block.fc1"),
    (scenarios.tiny_bug, "tp2-sp", "block.fc2"),
])
def test_planted_bugs_are_found_at_the_first_diverging_module(pool, scenario, layout, module):
    result = sc.parity(scenario, [layout, "dp2" if layout != "dp2" else "tp2"], pool=pool)
    report = result[layout]
    assert not result.ok and not report.ok
    assert report.first_divergence == module
    assert f"first diverging module: {module}" in str(result)
    upstream = [r for r in report.rows if r.kind == "module"]
    assert all(r.ok for r in upstream[:[r.name for r in upstream].index(module)])


def test_a_1e3_relative_bug_is_a_mismatch_and_a_per_rank_seed_breaks_replicas(pool):
    tiny = sc.parity(scenarios.tiny_bug, ["tp2"], pool=pool)["tp2"].row("module", "block.fc2")
    assert tiny.verdict == "MISMATCH" and 0.9e-3 < tiny.max_rel < 1.1e-3 and tiny.tol < 1e-4 * 1.4
    drop = sc.parity(scenarios.seed_bug, ["tp2"], pool=pool)["tp2"].row("module", "block.drop")
    assert drop.verdict == "REPLICA MISMATCH on tp" and drop.types == "tp=R"


def test_bugs_that_need_parallelism_stay_silent_where_it_is_absent(pool):
    assert scenarios.compared_clean(sc.parity(scenarios.count_bug, ["tp2", "dp2"], pool=pool), ["tp2", "dp2"])
    assert scenarios.compared_clean(sc.parity(scenarios.scale_bug, ["cp2", "dp2"], pool=pool), ["cp2", "dp2"])


def test_the_result_prints_as_a_table(pool):
    text = str(sc.parity(scenarios.correct, ["tp2"], pool=pool))
    assert text.splitlines()[0].startswith("parity tp2 vs 1 rank: ok")
    for word in ("max abs err", "max rel err", "tol", "verdict", "block.fc2", "block.fc1.weight"):
        assert word in text
