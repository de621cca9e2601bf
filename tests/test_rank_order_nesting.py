"""Two axes that cut one dim, under either rank order (tp faster, the default, or cp faster, as
explicit groups give at tp2-cp2-sp@cp-tp): the nesting they declare and the gradient of a
per-head parameter sliced by the cp rank from its tp shard (Mamba's ``_slice_vector_param``).
One process plays each of the four ranks in turn; no collective runs."""

import pytest
import torch

import shardcheck as sc

ORDERS = {  # rank -> (its tp group, its cp group)
    "tp-cp": lambda r: ([r - r % 2, r - r % 2 + 1], [r % 2, r % 2 + 2]),
    "cp-tp": lambda r: ([r % 2, r % 2 + 2], [r - r % 2, r - r % 2 + 1]),
}
CASES = [(order, rank) for order in ORDERS for rank in range(4)]


def _mesh(order: str, rank: int) -> sc.Mesh:
    tp, cp = ORDERS[order](rank)
    return sc.Mesh(rank=rank, tp=tp, cp=cp)


def _shown(t: torch.Tensor) -> dict[str, str]:
    return {a: repr(p) for a, p in sc.typeof(t).items()}


@pytest.mark.parametrize(("order", "rank"), CASES)
def test_nested_is_the_type_the_checker_gives_a_cut_of_a_cut(order, rank):
    """cp's piece of the sequence cut again by the tp rank (sequence parallelism): the slice
    rule's type and ``Mesh.nested(0, "cp", "tp")`` agree, with ``outside`` on cp where cp is
    the faster axis (else the pair would read tp outermost)."""
    mesh = _mesh(order, rank)
    with sc.typecheck(mesh):
        t = mesh.axes["tp"].ranks.index(rank)
        piece = sc.annotate(torch.randn(8, 3), tp=sc.R, cp=sc.S(0))
        cut = piece.chunk(2)[t] * 1
        assert sc.typeof(cut) == mesh.nested(0, "cp", "tp")
    outside = "S(0, outside)" if order == "cp-tp" else "S(0)"
    assert {a: repr(p) for a, p in mesh.nested(0, "cp", "tp").items()} == {"cp": outside, "tp": "S(0)"}


def test_nested_takes_only_the_mesh_axes():
    with pytest.raises(ValueError, match="unknown axes"):
        _mesh("tp-cp", 0).nested(0, "cp", "dp")


@pytest.mark.parametrize(("outer", "inner"), [("tp", "cp"), ("cp", "tp")])
@pytest.mark.parametrize(("order", "rank"), CASES)
def test_a_shard_sliced_by_the_other_axis_rank_gives_its_gradient_back_whole_on_its_own(order, rank, outer, inner):
    """The slice is ``outer``'s shard cut into ``inner`` pieces (``outer`` outermost, whichever
    axis is faster); its gradient padded back into the parameter is a partial sum over ``inner``,
    still S(0) over ``outer``."""
    mesh = _mesh(order, rank)
    with sc.typecheck(mesh):
        k = mesh.axes[inner].ranks.index(rank)
        param = sc.annotate(torch.randn(4, requires_grad=True), **{outer: sc.S(0), inner: sc.R})
        piece = param[k * 2:(k + 1) * 2]
        nested = mesh.nested(0, outer, inner)
        assert sc.typeof(piece) == nested
        piece.backward(sc.annotate(torch.ones(2), **nested))
        assert _shown(param.grad) == {outer: "S(0)", inner: "P"}


@pytest.mark.parametrize(("order", "rank"), CASES)
def test_the_ssm_scenarios_sequence_parallel_input_reads_cp_outermost(order, rank):
    """The SSM scenarios' input, cut over cp then tp, declared as the checker types that cut
    (declared plain S(0) on both, it read tp outermost under cp-tp: the all-gather over tp of
    Megatron's in_proj left cp sections, and every per-head gradient a type-only entry)."""
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.scenarios.ssm import _typed_input

    mesh = _mesh(order, rank)
    with sc.typecheck(mesh):
        assert sc.typeof(_typed_input(torch.randn(2, 3), sp=True)) == mesh.nested(0, "cp", "tp")
        assert _shown(_typed_input(torch.randn(2, 3), sp=False))["cp"] == "S(0)"  # cp alone
