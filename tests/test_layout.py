import pytest
import torch
import torch.distributed as dist

from shardcheck.parity.launch import spawn_ranks
from shardcheck.parity.layout import Layout, LayoutError
from shardcheck.parity.scenario import ScenarioContext, build_groups
from shardcheck.typecheck.types import P, R, S


def test_parse_round_trips_and_sizes_the_world():
    layout = Layout.parse("tp2-dp2-sp")
    assert (layout.tp, layout.dp, layout.sp, layout.world_size) == (2, 2, True, 4)
    assert str(layout) == "tp2-dp2-sp"
    assert Layout.parse(str(Layout(tp=2, cp=2, pp=2))) == Layout(tp=2, cp=2, pp=2)


@pytest.mark.parametrize("text", ["", "tp", "tp2-tp2", "xx2", "tp0", "dp2-sp", "tp2--dp2", "tp2-sp-sp"])
def test_malformed_layout_strings_get_one_line(text):
    with pytest.raises(LayoutError) as info:
        Layout.parse(text)
    assert "\n" not in str(info.value) and str(info.value)


def test_default_order_puts_tp_fastest_then_cp_dp_pp():
    layout = Layout(tp=2, cp=2, dp=2)
    assert layout.partition("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.partition("cp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.partition("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.group_ranks("dp_cp", 1) == (1, 3, 5, 7)
    assert layout.coords(6) == {"tp": 0, "cp": 1, "dp": 1, "pp": 0}


def test_model_parallel_and_expert_groups():
    layout = Layout(tp=2, dp=2, pp=2, ep=2)
    assert layout.group_ranks("mp", 0) == (0, 1, 4, 5)
    assert layout.partition("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert Layout(tp=1, dp=4, ep=2).partition("ep") == [(0, 1), (2, 3)]


def test_an_expert_tp_size_round_trips_and_defaults_to_tp():
    layout = Layout.parse("tp2-dp2-ep2-etp1-sp")
    assert (layout.etp, layout.expert_tp, str(layout)) == (1, 1, "tp2-dp2-ep2-etp1-sp")
    assert Layout.parse(str(layout)) == layout
    assert Layout.parse("tp2-etp2") == Layout(tp=2) and Layout(tp=2).expert_tp == 2


def test_the_expert_grid_is_megatrons_etp_ep_edp_in_rank_order():
    # ETP 1 beside TP 2: ep is cut from the tp ranks (EP = TP), or the tp ranks hold the same experts
    assert {g: Layout.parse("tp2-ep2-etp1").partition(g) for g in ("etp", "ep", "edp")} == {
        "etp": [(0,), (1,)], "ep": [(0, 1)], "edp": [(0,), (1,)]}
    assert {g: Layout.parse("tp2-etp1").partition(g) for g in ("etp", "ep", "edp")} == {
        "etp": [(0,), (1,)], "ep": [(0,), (1,)], "edp": [(0, 1)]}
    assert Layout.parse("tp2-dp2-ep4-etp1").partition("ep") == [(0, 1, 2, 3)]
    # the default etp: etp is tp, ep blocks of each dp x cp group, edp the rest of it
    default = Layout(tp=2, dp=4, ep=2)
    assert default.partition("etp") == default.partition("tp")
    assert default.partition("ep") == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert default.partition("edp") == [(0, 4), (2, 6), (1, 5), (3, 7)]


@pytest.mark.parametrize("text", ["tp2-ep4-etp1", "tp2-etp3", "dp2-etp4", "tp2-dp2-etp1@dp-tp"])
def test_expert_grids_megatron_cannot_build_get_one_line(text):
    with pytest.raises(LayoutError) as info:
        Layout.parse(text)
    assert "\n" not in str(info.value) and "etp" in str(info.value)


def test_custom_order_moves_dp_fastest():
    layout = Layout(tp=2, dp=2, order="dp-tp-cp-pp")
    assert layout.partition("dp") == [(0, 1), (2, 3)]
    assert layout.partition("tp") == [(0, 2), (1, 3)]


def test_explicit_groups_replace_the_default_ones():
    layout = Layout(tp=2, dp=2, explicit_groups={"tp": [[0, 2], [1, 3]], "dp": [[0, 1], [2, 3]]})
    assert layout.group_ranks("tp", 2) == (0, 2)
    assert layout.coords(2) == {"tp": 1, "cp": 0, "dp": 0, "pp": 0}
    assert layout != Layout(tp=2, dp=2) and str(layout) == "tp2-dp2@dp-tp"
    assert Layout.parse(str(layout)) == layout


def test_explicit_groups_that_break_the_grid_are_refused():
    with pytest.raises(LayoutError, match="grid"):
        Layout(tp=2, dp=2, explicit_groups={"tp": [[0, 2], [1, 3]]})
    with pytest.raises(LayoutError, match="split ranks"):
        Layout(tp=2, dp=2, explicit_groups={"tp": [[0, 1, 2], [3]]})


def _context_view(layout):
    rank = dist.get_rank()
    ctx = ScenarioContext(layout, rank, build_groups(layout, rank))
    weight = torch.arange(8.0).reshape(4, 2)
    total = torch.tensor([1.0])
    dist.all_reduce(total, group=ctx.groups["tp"])
    return {
        "tp_ranks": dist.get_process_group_ranks(ctx.groups["tp"]),
        "mesh_tp": ctx.mesh.axes["tp"].ranks,
        "tp_sum": total.item(),
        "shard": ctx.shard(weight, S(0), "tp").tolist(),
        "partial": ctx.shard(weight, P, "dp").sum().item(),
        "replica": ctx.shard(weight, R, "dp").sum().item(),
    }


def test_context_builds_real_groups_and_shards_by_position():
    layout = Layout(tp=2, dp=2, explicit_groups={"tp": [[0, 2], [1, 3]], "dp": [[0, 1], [2, 3]]})
    views = spawn_ranks(_context_view, 4, layout)
    assert [v["tp_ranks"] for v in views] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert views[2]["mesh_tp"] == (0, 2)
    assert all(v["tp_sum"] == 2.0 for v in views)
    assert views[0]["shard"] == [[0.0, 1.0], [2.0, 3.0]] and views[2]["shard"] == [[4.0, 5.0], [6.0, 7.0]]
    assert [v["partial"] for v in views] == [28.0, 0.0, 28.0, 0.0]
    assert all(v["replica"] == 28.0 for v in views)
