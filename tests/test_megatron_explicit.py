"""Explicit process groups: Megatron given a ProcessGroupCollection that differs from parallel_state.

Real Gloo ranks and real megatron-core: a planted plain-torch reduction over the global tensor-
parallel group where the explicit one is given is flagged (and its correct twin is not), and the
audit finds megatron-core 0.16.1's vocab-parallel cross-entropy reducing over the global group.
"""

import inspect
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron_release import fixed_in  # noqa: E402

from shardcheck.cli.audit import audit_command  # noqa: E402
from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD, pools  # noqa: E402
from shardcheck.megatron.audit.sweep import Case, in_te_tier, layouts, plan, runs_under  # noqa: E402
from shardcheck.megatron.cpu.parallel import megatron_parallel, scenario_groups  # noqa: E402
from shardcheck.megatron.scenarios import COMPONENTS, Component  # noqa: E402
from shardcheck.megatron.scenarios.reference import seeded_global  # noqa: E402
from shardcheck.parity.layout import Layout, LayoutError  # noqa: E402

for module in PRELOAD:
    __import__(module)

EXPLICIT = Layout.parse("tp2-dp2@dp-tp")  # tp {0,2},{1,3}; parallel_state's tp {0,1},{2,3}


# ---- layouts and the sweep (no ranks) ------------------------------------------------------

def test_an_at_order_gives_the_groups_of_that_rank_order_and_round_trips():
    assert EXPLICIT.partition("tp") == [(0, 2), (1, 3)] and EXPLICIT.partition("dp") == [(0, 1), (2, 3)]
    assert EXPLICIT.global_layout.partition("tp") == [(0, 1), (2, 3)]
    assert str(EXPLICIT) == "tp2-dp2@dp-tp" and Layout.parse(str(EXPLICIT)) == EXPLICIT
    assert EXPLICIT.spanning(["tp", "dp"]) == [(0, 1, 2, 3)]


@pytest.mark.parametrize("text, message", [("tp2-dp2@tp", "default groups"),
                                           ("tp2-dp2@xx", "malformed group order")])
def test_a_bad_at_order_is_one_clear_line(text, message):
    with pytest.raises(LayoutError, match=message):
        Layout.parse(text)
    result = CliRunner().invoke(audit_command, ["--layouts", text])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_the_sweep_runs_defaults_and_options_under_explicit_layouts_for_components_that_pass_the_groups():
    explicit = [lay for lay in layouts(explicit=True) if lay.explicit_groups]
    assert not any(lay.explicit_groups for lay in layouts())
    assert {str(lay) for lay in explicit} >= {"tp2-dp2@dp-tp", "tp2-cp2@cp-tp", "cp2-dp2@dp-cp"}
    assert not any(lay.pp > 1 for lay in explicit)
    cases = plan({"gpt": [("loss_mask", True)], "other": [("x", True)]}, [Layout(tp=2), EXPLICIT], None)
    # the Transformer Engine tier's own option sets join where TE is installed (sweep.te_option_sets)
    assert [c for c in cases if c.layout == EXPLICIT and not in_te_tier(c)] == [
        Case("gpt", (), EXPLICIT), Case("gpt", (("loss_mask", True),), EXPLICIT)]
    assert runs_under("other", Layout(tp=2)) and not runs_under("other", EXPLICIT)


# ---- on real ranks ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PlantedSetup:
    rows: int = 4
    width: int = 8


def _row_parallel(ctx, setup: PlantedSetup, on_global_group: bool) -> dict[str, torch.Tensor]:
    """x @ w with w's rows (x's columns) split over the model's tp group, partial sums reduced."""
    from megatron.core import parallel_state as ps

    with megatron_parallel(ctx) as pg:
        tp = scenario_groups(pg).tp
        x = seeded_global("x", (setup.rows, setup.width)).float()
        w = seeded_global("w", (setup.width, 3)).float()
        part = setup.width // tp.size()
        mine = slice(tp.rank() * part, (tp.rank() + 1) * part)
        out = x[:, mine] @ w[mine]
        dist.all_reduce(out, group=ps.get_tensor_model_parallel_group() if on_global_group else tp)
        return {"out": out}


def planted_global_group(ctx, setup: PlantedSetup):
    return _row_parallel(ctx, setup, on_global_group=True)


def planted_explicit_group(ctx, setup: PlantedSetup):
    return _row_parallel(ctx, setup, on_global_group=False)


def _planted_line() -> str:
    """Where the planted reduction is issued: the all_reduce line of ``_row_parallel``."""
    lines, start = inspect.getsourcelines(_row_parallel)
    return f"tests/test_megatron_explicit.py:{start + next(i for i, t in enumerate(lines) if 'all_reduce' in t)}"


PLANTED_LINE = _planted_line()


def _collection_ranks(ctx):
    from megatron.core import parallel_state as ps

    from shardcheck.megatron.checks.typing import mesh_from_pg_collection

    with megatron_parallel(ctx) as pg:
        names = ("tp", "dp", "dp_cp", "tp_cp", "mp", "tp_dp_cp", "cp", "pp")
        return ({name: tuple(dist.get_process_group_ranks(getattr(pg, name))) for name in names},
                tuple(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())),
                {name: axis.ranks for name, axis in mesh_from_pg_collection(pg).axes.items()})


@pytest.fixture(scope="module")
def warm():
    planted = {"planted_global_group": Component(planted_global_group, PlantedSetup, explicit_groups=True),
               "planted_explicit_group": Component(planted_explicit_group, PlantedSetup, explicit_groups=True)}
    COMPONENTS.update(planted)  # before the pools fork, so their ranks know the planted ones
    try:
        with pools() as shared:
            yield shared
    finally:
        for name in planted:
            del COMPONENTS[name]


@pytest.fixture(scope="module")
def audited(warm):
    return audit([Case("planted_global_group", (), EXPLICIT),
                  Case("planted_explicit_group", (), EXPLICIT),
                  Case("planted_global_group", (), Layout(tp=2, dp=2)),
                  Case("output_loss", (), EXPLICIT)], run_pools=warm)


@pytest.mark.slow
def test_the_explicit_collection_holds_the_explicit_groups_and_parallel_state_the_global_ones(warm):
    per_rank = warm.run(EXPLICIT, _collection_ranks)
    collection, global_tp, mesh = per_rank[1]
    assert collection["tp"] == (1, 3) and collection["dp"] == collection["dp_cp"] == (0, 1)
    assert collection["tp_cp"] == (1, 3) and collection["mp"] == (1, 3)
    assert collection["tp_dp_cp"] == (0, 1, 2, 3) and collection["cp"] == collection["pp"] == (1,)
    assert global_tp == (0, 1)
    assert mesh["tp"] == (1, 3) and mesh["dp"] == (0, 1)


def _finding(result, component):
    return [f for f in result.findings if f.trigger["component"] == component]


@pytest.mark.slow
def test_a_reduction_over_the_global_group_is_flagged_where_it_happens_with_a_corrected_control(audited):
    [finding] = _finding(audited, "planted_global_group")
    assert finding.location == PLANTED_LINE and finding.kind == "type+numeric"
    assert finding.checker.startswith(f"checker: {PLANTED_LINE}: all_reduce on parallel_state's global tp")
    assert "pg_collection.tp" in finding.checker and finding.trigger["layout"] == "tp2-dp2@dp-tp"
    assert finding.effect[0]["max_abs_error"] > 1e-3
    assert finding.control["equal_to_reference"], finding.control
    assert finding.seen_in == ["layouts: tp2-dp2@dp-tp"]  # the same code is right where the groups agree


@pytest.mark.slow
def test_the_reduction_over_the_explicit_group_is_clean(audited):
    assert not _finding(audited, "planted_explicit_group")
    judged = [o for o in audited.outcomes
              if o.case.component == "planted_explicit_group" or not o.case.layout.explicit_groups]
    assert len(judged) == 2  # the explicit-group component, and the global one under plain groups
    assert all(not o.failed and not o.error for o in judged)


@pytest.mark.slow
@fixed_in("0.19", "the language model passes its own tp group to vocab_parallel_cross_entropy")
def test_megatron_cross_entropy_reduces_over_the_global_tp_group_despite_an_explicit_one(audited):
    [finding] = _finding(audited, "output_loss")
    assert finding.location.startswith("megatron/core/tensor_parallel/cross_entropy.py:")
    assert finding.kind == "type+numeric" and "pg_collection.tp" in finding.checker
    assert finding.title.startswith("all_reduce on parallel_state's global tp group")
    assert finding.effect[0]["max_abs_error"] > 1e-3
    assert finding.control["equal_to_reference"], finding.control
    assert finding.reproduce == "shardcheck audit --only output_loss --layouts tp2-dp2@dp-tp"
