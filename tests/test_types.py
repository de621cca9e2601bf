import pytest

from shardcheck.typecheck.types import I, Mesh, P, R, S, V, parse_placement


def test_placements_repr_and_interning():
    assert [repr(p) for p in (R, P, V, I, S(-1))] == ["R", "P", "V", "I", "S(-1)"]
    assert S(0) is S(0) and S(0) == S(0) and S(0) != S(1)


@pytest.mark.parametrize("text", ["R", "P", "V", "I", "S(2)", "S(-1)"])
def test_parse_placement_roundtrip(text):
    assert repr(parse_placement(text)) == text


def test_parse_placement_rejects_garbage():
    with pytest.raises(ValueError, match="unknown placement"):
        parse_placement("Q")


def test_mesh_matches_single_and_combined_axes_by_rank_sets():
    # rank 1 of a tp2 x cp2 x dp2 grid in Megatron order (tp fastest).
    mesh = Mesh(tp=[0, 1], cp=[1, 3], dp=[1, 5])
    assert mesh.axes_of([0, 1]) == ("tp",)
    assert mesh.axes_of([1, 3, 5, 7]) == ("cp", "dp")
    assert mesh.axes_of([0, 1, 2, 3]) == ("tp", "cp")
    assert mesh.axes_of([1]) == ()
    assert mesh.axes_of([0, 2]) is None  # a group over other ranks: no axis of this mesh


def test_a_group_over_the_ranks_of_two_axes_acts_on_both():
    mesh = Mesh(rank=1, tp=[0, 1], dp=[1, 3], ep=[1, 3])  # Megatron's ep cut from dp, equal here
    assert mesh.axes_of([1, 3]) == ("dp", "ep")
    assert mesh.axes_of([0, 1, 2, 3]) == ("tp", "dp", "ep")


def test_mesh_rejects_unknown_axis_names():
    with pytest.raises(ValueError, match="unknown axes"):
        Mesh(rank=0, tp=[0, 1]).placements({"ep": R})
