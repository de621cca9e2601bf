"""Types of real Megatron parameters and meshes, built under real Gloo layouts."""

import pytest

pytest.importorskip("megatron.core")

import megatron.core.models.gpt.gpt_model  # noqa: E402, F401  (imported once, before forking)
from megatron_release import fixed_in  # noqa: E402

from shardcheck.megatron.checks.typing import (  # noqa: E402
    annotate_model,
    input_types,
    mesh_from_parallel_state,
    mesh_from_pg_collection,
    parameter_type,
    parameter_types,
)
from shardcheck.megatron.cpu.parallel import megatron_parallel  # noqa: E402
from shardcheck.megatron.cpu.runner import RankContext  # noqa: E402
from shardcheck.megatron.scenarios.gpt import GPTSetup, build_gpt, transformer_config  # noqa: E402
from shardcheck.parity.launch import spawn_ranks  # noqa: E402
from shardcheck.parity.layout import Layout
from shardcheck.typecheck.types import R, S, SectionShard, V  # noqa: E402

pytestmark = pytest.mark.slow


def _types_on_rank(layout: Layout, config: dict) -> tuple:
    import torch.distributed as dist

    with megatron_parallel(RankContext(layout, dist.get_rank())):
        setup = GPTSetup(config=config)
        model = _build(transformer_config(layout, setup), setup)
        mesh = mesh_from_parallel_state()
        types = {name: (repr(t.placements), t.grad_reduced_over)
                 for name, t in parameter_types(model).items()}
        return types, {name: axis.ranks for name, axis in mesh.axes.items()}


def _build(config, setup: GPTSetup):
    """The scenario's GPT; with experts, Megatron's local MoE spec (SequentialMLP experts)."""
    if not config.num_moe_experts:
        return build_gpt(config, setup)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=setup.vocab,
                    max_sequence_length=setup.seq)


def _run(layout: Layout, config: dict | None = None):
    return spawn_ranks(_types_on_rank, layout.world_size, layout, config or {})


def _placements(text: str) -> dict:
    return eval(text, {"R": R, "V": V, "S": _shard})  # repr of {axis: placement}


def _shard(dim: int, sections: list[int] | None = None):
    return SectionShard(dim, tuple(sections)) if sections else S(dim)


def test_tp2_sp_gpt_parameters_are_typed_from_megatron_metadata():
    (types, axes), _ = _run(Layout(tp=2, sp=True))
    qkv, qkv_reduced = types["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert _placements(qkv)["tp"] == S(0) and qkv_reduced == ()
    assert _placements(types["decoder.layers.0.self_attention.linear_proj.weight"][0])["tp"] == S(1)
    assert _placements(types["embedding.word_embeddings.weight"][0])["tp"] == S(0)
    norm, norm_reduced = types["decoder.layers.0.input_layernorm.weight"]
    assert _placements(norm)["tp"] == R and norm_reduced == ("tp",)
    assert all(_placements(text)["dp"] == R for text, _ in types.values())
    assert all(_placements(text)["pp"] == V for text, _ in types.values())  # a stage's own layers
    assert axes["tp"] == (0, 1) and axes["dp"] == (0,)


def _tp_attributes(layout: Layout, config: dict) -> tuple[dict[str, bool], dict, list]:
    """Which parameters carry ``tensor_model_parallel``; the tp type ``annotate_model`` gives
    the qkv weight in a typecheck, and the violations that annotating left."""
    import torch.distributed as dist

    import shardcheck as sc

    with megatron_parallel(RankContext(layout, dist.get_rank())):
        setup = GPTSetup(config=config)
        model = _build(transformer_config(layout, setup), setup)
        qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
        with sc.typecheck(mesh_from_parallel_state(), mode="collect"):
            annotate_model(model, ("tp",))
            annotated = sc.typeof(qkv)
            violations = [v.first_line for v in sc.violations()]
        return ({name: hasattr(param, "tensor_model_parallel")
                 for name, param in model.named_parameters()}, annotated, violations)


@fixed_in("0.19", "weights built without perform_initialization get no tensor_model_parallel")
def test_weights_left_without_tp_attributes_are_typed_from_their_checkpoint_cut():
    """Without ``perform_initialization`` Megatron's parallel linear layers and embedding never
    set ``tensor_model_parallel`` on their weights; their sharded_state_dict still cuts them."""
    config = {"perform_initialization": False, "gated_linear_unit": True}
    ranks = spawn_ranks(_tp_attributes, 2, Layout(tp=2), config)
    assert [rank[1:] for rank in ranks] == [({"tp": S(0)}, [])] * 2  # on each rank: S(0), no violation
    has_attribute = ranks[0][0]
    assert ranks[1][0] == has_attribute  # the same weights lack the attribute on both ranks
    (types, _), _ = _run(Layout(tp=2), config)
    layer = "decoder.layers.0."
    for name, expected in [(f"{layer}self_attention.linear_qkv.weight", S(0)),
                           (f"{layer}self_attention.linear_proj.weight", S(1)),
                           (f"{layer}mlp.linear_fc1.weight", SectionShard(0, (64, 64))),
                           ("embedding.word_embeddings.weight", S(0)),
                           (f"{layer}input_layernorm.weight", R),  # not cut: replicated
                           ("embedding.position_embeddings.weight", R)]:
        assert not has_attribute[name]
        assert _placements(types[name][0])["tp"] == expected, name


def test_without_sequence_parallelism_norms_need_no_tp_reduction():
    (types, _), _ = _run(Layout(tp=2))
    assert types["decoder.layers.0.input_layernorm.weight"][1] == ()
    assert _placements(types["embedding.position_embeddings.weight"][0])["tp"] == R


def test_expert_weights_are_sharded_over_ep():
    moe = {"num_moe_experts": 4, "moe_router_topk": 2, "add_bias_linear": False}
    (types, axes), _ = _run(Layout(dp=2, ep=2), moe)
    experts = {n: _placements(t) for n, (t, _) in types.items() if ".experts." in n}
    assert experts and all(p["ep"] == S(0) and p["tp"] == R for p in experts.values())
    router = _placements(types["decoder.layers.0.mlp.router.weight"][0])
    assert router["ep"] == R
    assert axes["ep"] == (0, 1) == axes["dp"]
    assert all(p["dp"] == S(0) for p in experts.values())  # the dp ranks are the ep ranks


def _expert_type_on_rank(layout: Layout) -> tuple:
    import torch
    import torch.distributed as dist

    with megatron_parallel(RankContext(layout, dist.get_rank())):
        weight = torch.nn.Parameter(torch.zeros(2, 2))
        weight.allreduce = False  # what Megatron marks its expert parameters with
        axes = {name: axis.ranks for name, axis in mesh_from_parallel_state().axes.items()}
        return parameter_type(weight).placements, axes


def test_expert_weights_are_typed_on_cp_and_dp_by_their_ranks():
    """At cp2-ep2 and cp2-dp2-ep2 the ep group is the cp ranks, which hold different experts:
    S(0) on cp too; the dp ranks (one, or two holding the same experts) replicate them."""
    for layout in (Layout(cp=2, ep=2), Layout(cp=2, dp=2, ep=2)):
        for placements, axes in spawn_ranks(_expert_type_on_rank, layout.world_size, layout):
            assert axes["cp"] == axes["ep"] and len(set(axes["dp"]) & set(axes["ep"])) == 1, axes
            assert placements["cp"] == placements["ep"] == S(0) and placements["dp"] == R, (layout, placements)


def _explicit_mesh_axes(layout):
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    with megatron_parallel(RankContext(layout, dist.get_rank())):
        collection = ProcessGroupCollection()
        collection.tp = dist.new_group([0, 1])
        collection.cp = dist.new_group([dist.get_rank()])
        return {name: axis.ranks for name, axis in mesh_from_pg_collection(collection).axes.items()}


def test_mesh_from_an_explicit_pg_collection_uses_its_groups():
    axes = spawn_ranks(_explicit_mesh_axes, 2, Layout(dp=2))
    assert axes[0] == {"tp": (0, 1), "cp": (0,)} and axes[1] == {"tp": (0, 1), "cp": (1,)}


def test_inputs_are_varying_over_dp_and_sequence_sharded_over_cp():
    tokens = input_types("tokens")
    assert tokens["dp"] == V and tokens["cp"] == S(1) and tokens["tp"] == R
    assert input_types("attention_mask", seq_dim=2)["cp"] == S(2)
    with pytest.raises(ValueError, match="unknown input role"):
        input_types("weights")


def _harness_types_on_rank() -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core.utils import make_viewless_tensor

    import shardcheck as sc
    from shardcheck.megatron.checks import typecheck
    from shardcheck.megatron.scenarios import training
    from shardcheck.typecheck.types import Mesh

    found = {}
    world = dist.group.WORLD
    with megatron_parallel(RankContext(Layout(dp=2), dist.get_rank())), \
            sc.typecheck(Mesh(rank=dist.get_rank(), tp=world, dp=world), mode="collect"):
        view = sc.annotate(torch.randn(4, 6), tp=S(1), dp=R)[:3]  # a view, no rank chunk
        found["viewless"] = sc.typeof(make_viewless_tensor(view, True, True))  # out.data = inp.data
        with typecheck.harness_values_typed(("tp", "dp")):
            batches = training.data_parallel_share([{"ids": torch.zeros(3)} for _ in range(2)])
            found["batch share"] = sc.typeof(batches[0]["ids"])
    return {name: {axis: repr(p) for axis, p in types.items()} for name, types in found.items()}


def test_harness_and_viewless_tensors_keep_their_types():
    expected = {"viewless": {"tp": "S(1)", "dp": "R"}, "batch share": {"tp": "R", "dp": "V"}}
    assert spawn_ranks(_harness_types_on_rank, 2) == [expected] * 2  # every rank's own types


def test_the_harness_helpers_type_their_values_on_the_checked_regions_axes_only():
    """A seeded global is drawn alike on every rank (R); this rank's sequence chunk (S(0) over
    tp) and CP positions (S(0) over cp) are its shard. Outside the harness's block, or on an
    axis its block leaves out, the checker's own type stays."""
    import shardcheck as sc
    from shardcheck.megatron.checks.typecheck import harness_values_typed
    from shardcheck.megatron.cpu.cp_attention import load_balanced_positions
    from shardcheck.megatron.scenarios.output_loss import _sequence_shard
    from shardcheck.megatron.scenarios.reference import seeded_global
    from shardcheck.typecheck.types import Mesh

    class Group:
        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return 0

    with sc.typecheck(Mesh(rank=0, tp=[0, 1], cp=[0, 1]), mode="collect"):
        assert sc.typeof(seeded_global("x", (4, 2))) == {"tp": V, "cp": V}  # drawn: varying
        with harness_values_typed(("tp",)):
            assert sc.typeof(seeded_global("x", (4, 2))) == {"tp": R, "cp": V}
            assert sc.typeof(_sequence_shard(seeded_global("x", (4, 2)), True, Group()))["tp"] == S(0)
            assert sc.typeof(load_balanced_positions(4, 0, 2))["cp"] == R  # a constant: cp left out
        with harness_values_typed(("tp", "cp")):
            assert sc.typeof(load_balanced_positions(4, 0, 2)) == {"tp": R, "cp": S(0)}


def test_expert_weights_cut_over_the_tp_ranks_are_typed_on_tp():
    """With Megatron's default expert tensor parallelism (the experts cut over the dense
    layers' tp ranks), the mesh's tp axis carries the experts' cut: their fc1 is a column
    shard and their fc2 a row shard over tp, as the dense MLP's (R before, which made the
    combine's reduce-scatter input look replicated)."""
    moe = {"num_moe_experts": 4, "moe_router_topk": 2, "add_bias_linear": False}
    (types, _), _ = _run(Layout(tp=2, sp=True), moe)
    experts = {n: _placements(t) for n, (t, _) in types.items() if ".experts." in n}
    fc1 = [p["tp"] for n, p in experts.items() if "linear_fc1" in n]
    fc2 = [p["tp"] for n, p in experts.items() if "linear_fc2" in n]
    assert fc1 and fc2 and all(p == S(0) for p in fc1) and all(p == S(1) for p in fc2), experts


def _kept_types_on_rank(layout: Layout) -> dict:
    import torch
    import torch.distributed as dist

    from shardcheck.megatron.checks.typecheck import _types_by_id

    with megatron_parallel(RankContext(layout, dist.get_rank())):
        setup = GPTSetup()
        model = _build(transformer_config(layout, setup), setup)
        attention = model.decoder.layers[0].self_attention
        first = _types_by_id(model)
        found = {"kept": _types_by_id(model) is first}
        attention.linear_qkv.weight.partition_dim = 1  # an attribute the type is read from
        found["after attribute"] = repr(_types_by_id(model)[id(attention.linear_qkv.weight)].placements)
        old = attention.linear_proj.weight
        attention.linear_proj.weight = torch.nn.Parameter(old.detach().clone())  # no attributes
        found["replaced"] = repr(_types_by_id(model)[id(attention.linear_proj.weight)].placements)
        found["fresh"] = repr({name: t.placements for name, t in parameter_types(model).items()})
        found["cached"] = repr({name: _types_by_id(model)[id(p)].placements
                                for name, p in model.named_parameters()})
        return found


def test_parameter_types_are_kept_between_steps_until_what_they_are_read_from_changes():
    """A checked region reads every parameter's type at each step: they are kept per module,
    and read again when a parameter's attributes change or a parameter is replaced."""
    for found in spawn_ranks(_kept_types_on_rank, 2, Layout(tp=2, sp=True)):
        assert found["kept"]
        assert _placements(found["after attribute"])["tp"] == S(1)
        assert _placements(found["replaced"])["tp"] == S(1)  # from its checkpoint cut, no attribute
        assert found["cached"] == found["fresh"]
