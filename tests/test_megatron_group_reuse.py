"""A warm rank process reuses Megatron's process groups between layouts.

Each Gloo group keeps a thread polling its sockets. Without reuse, rank 0 of a 4-rank pool held
165 process groups after the nine layouts below, 88 of Megatron's over rank 0 alone, and a
field's group over ranks 0 and 1 five times; with it 39, Megatron's 34 being one over itself
and one per field and set of ranks. Scenarios on the reused groups still match one rank.
"""

from collections import Counter

import pytest

pytest.importorskip("megatron.core")

import megatron.core.parallel_state  # noqa: E402, F401  (imported once, before forking)
import torch.distributed as dist  # noqa: E402
from parity_scenarios import compared_clean  # noqa: E402

from shardcheck.megatron.cpu.parallel import megatron_parallel  # noqa: E402
from shardcheck.megatron.scenarios import scenario  # noqa: E402
from shardcheck.parity.compare import parity  # noqa: E402
from shardcheck.parity.pool import RankPool  # noqa: E402

LAYOUTS = ["tp2", "dp2", "cp2", "tp2-sp", "pp2", "tp2-dp2", "cp2-dp2", "dp2-pp2", "tp2-pp2"]


def _enter(ctx):
    with megatron_parallel(ctx):
        pass


def _megatron_groups(ctx) -> list[tuple[str, tuple[int, ...]]]:
    """The field (``group_desc``) and ranks of every group Megatron made in this process."""
    world = dist.distributed_c10d._world
    return [(group.group_desc, tuple(world.pg_group_ranks[group]))
            for group, name in world.pg_names.items() if name.startswith("megatron:")]


@pytest.fixture(scope="module")
def ran():
    """A 4-rank pool that ran the layouts, and the groups each rank holds after them."""
    with RankPool(4, timeout=300, checker=False) as pool:
        for layout in LAYOUTS:
            pool.run(layout, _enter)
        yield pool, pool.run("tp2-dp2", _megatron_groups)


def test_each_rank_holds_one_megatron_group_over_itself_alone(ran):
    _, held = ran
    assert [sum(len(ranks) == 1 for _, ranks in groups) for groups in held] == [1, 1, 1, 1]


def test_a_field_holds_one_group_over_the_same_ranks_whatever_the_layouts_that_asked(ran):
    _, held = ran
    for groups in held:
        fields = Counter((desc, ranks) for desc, ranks in groups if len(ranks) > 1)
        assert fields and max(fields.values()) == 1, fields.most_common(3)


def test_scenarios_on_the_reused_groups_match_one_rank(ran):
    pool, _ = ran
    layouts = ["tp2-sp", "tp2-dp2", "cp2-dp2"]
    result = parity(scenario("output_loss"), layouts, pool=pool, noise_runs=0, typecheck=False,
                    timeout=300)
    assert compared_clean(result, layouts), str(result)


def _moe_metrics_of_two_models(ctx) -> bool:
    """A 2-layer model's MoE metric, then a 4-layer one's at layer 4, each in its own case."""
    import torch
    from megatron.core.transformer.moe import moe_logging

    for layers in (2, 4):
        with megatron_parallel(ctx):
            moe_logging.get_moe_metrics_tracker().record("load_balancing_loss", torch.ones(()), layers, layers)
    return moe_logging._MOE_METRICS_TRACKER is None


def test_megatrons_moe_metrics_tracker_is_left_behind_with_its_groups(ran):
    """Its per-layer tensors are sized by the first model that records: kept across cases, a
    warm rank's next, deeper model indexed past them (a false one-rank crash in the audit)."""
    pytest.importorskip("megatron.core.transformer.moe.moe_logging")
    pool, _ = ran
    assert pool.run("tp2", _moe_metrics_of_two_models) == [True, True]
