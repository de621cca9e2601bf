"""The checker against the numbers on generated programs (a small share of the benchmark's
10,000; bench/checker_oracle.py) and on the saved regressions."""

import pytest
from hypothesis import HealthCheck, given, settings
from oracle_regressions import REGRESSIONS

from shardcheck.fuzz.oracle import Input, Program, Step, check, judge, local_inputs, on_rank, valid
from shardcheck.fuzz.oracle_gen import programs
from shardcheck.parity.pool import RankPool


@pytest.fixture(scope="module")
def pool():
    with RankPool(4) as ranks:
        yield ranks


@pytest.mark.parametrize(("program", "outcome", "step"), [r[1:] for r in REGRESSIONS], ids=[r[0] for r in REGRESSIONS])
def test_regression(pool, program, outcome, step):
    verdict = check(pool, program)
    assert (verdict.outcome, verdict.first_wrong) == (outcome, step), verdict.why


@settings(max_examples=30, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(program=programs())
def test_generated_programs_agree_with_the_numbers(pool, program):
    verdict = check(pool, program)
    assert verdict.agrees, f"{verdict.outcome}: {verdict.why}"


def test_a_wrong_program_is_rejected_at_its_first_wrong_step(pool):
    program = Program("tp2", (Input((8, 8), (("tp", "P"),)),),
                      (Step("neg", (0,), ()), Step("gelu", (1,), ()), Step("f_all_reduce", (2,), (("g", "tp"),))))
    verdict = check(pool, program)
    assert (verdict.outcome, verdict.first_wrong, verdict.flagged) == ("wrong", 1, (1, "non-linear on partial"))


def test_a_false_alarm_and_a_miss_are_told(pool):
    """The judge itself: a report at a step whose numbers fit is a false alarm, a wrong step
    typed as if right is a miss (the ranks' results are edited to make each)."""
    program = Program("tp2", (Input((8, 8), (("tp", "P"),)),), (Step("f_all_reduce", (0,), (("g", "tp"),)),))
    assert valid(program)
    results = pool.run("tp2", on_rank, program, local_inputs(program))
    assert judge(program, results).outcome == "right"
    alarmed = [{**r, "records": [{"rule": "double count", "location": "<step 0>:1"}]} for r in results]
    assert judge(program, alarmed).outcome == "false alarm"
    mistyped = [{**r, "types": [(("P",),)]} for r in results]
    assert judge(program, mistyped).outcome == "miss"
