import pytest
import torch

from shardcheck.parity.assemble import NotComparable, assemble, compare, tolerance
from shardcheck.parity.layout import Layout
from shardcheck.typecheck.types import P, R, S, V


def _split_matmul(x, w, ranks):
    """Row-parallel partial products: each rank contracts its slice of the inner dimension."""
    return [a @ b for a, b in zip(x.chunk(ranks, 1), w.chunk(ranks, 0), strict=True)]


def _noise(x, w, reference, runs=2):
    """How far the one-rank reference moves when its inputs move by 4 machine epsilons."""
    eps = torch.finfo(x.dtype).eps
    changes = []
    for seed in range(runs):
        g = torch.Generator().manual_seed(seed)
        px = x * (1 + 4 * eps * (torch.rand(x.shape, generator=g) * 2 - 1))
        pw = w * (1 + 4 * eps * (torch.rand(w.shape, generator=g) * 2 - 1))
        changes.append((px @ pw - reference).abs().max().item())
    return max(changes)


@pytest.mark.parametrize("seed", range(40))
def test_reassociation_never_alarms_and_a_1e3_relative_fp32_bug_always_does(seed):
    g = torch.Generator().manual_seed(seed)
    rows, inner = int(torch.randint(1, 9, (1,), generator=g)), 64 * int(torch.randint(1, 33, (1,), generator=g))
    magnitude = 10.0 ** float(torch.randint(-6, 7, (1,), generator=g))
    x = torch.randn(rows, inner, generator=g) * magnitude
    w = torch.randn(inner, 5, generator=g) + (0.5 if seed % 2 else 0.0)
    reference = x @ w
    noise = _noise(x, w, reference)
    layout = Layout(tp=4)
    parts = _split_matmul(x, w, 4)
    assert compare(parts, reference, noise, layout, {"tp": P}).ok
    buggy = [p * (1 + 1e-3) for p in parts]
    assert not compare(buggy, reference, noise, layout, {"tp": P}).ok


def test_tolerance_is_floored_by_the_dtype_and_capped_for_fp32():
    ref = torch.tensor([2.0, -4.0])
    eps = torch.finfo(torch.float32).eps
    assert tolerance(ref, 0.0, torch.float32) == pytest.approx(32 * eps * 4)
    assert tolerance(ref, 1.0, torch.float32) == pytest.approx(1e-4 * 4)
    assert tolerance(ref, 1e-5, torch.float32) == pytest.approx(4e-5)
    assert tolerance(ref, 0.0, torch.bfloat16) > tolerance(ref, 0.0, torch.float32)


def test_assemble_concatenates_sums_and_checks_replicas_on_a_grid():
    layout = Layout(tp=2, dp=2)  # ranks 0,1 and 2,3 are tp groups; 0,2 and 1,3 dp groups
    values = [torch.full((1, 1), float(r)) for r in range(4)]
    value, replica = assemble(values, layout, {"tp": S(1), "dp": V})
    assert value.tolist() == [[0.0, 1.0], [2.0, 3.0]] and replica == {"tp": 0.0, "dp": 0.0}
    value, _ = assemble(values, layout, {"tp": P, "dp": S(0)})
    assert value.tolist() == [[1.0], [5.0]]
    _, replica = assemble(values, layout, {"tp": R, "dp": S(0)})
    assert replica["tp"] == 1.0


def test_a_replica_mismatch_is_its_own_finding():
    layout = Layout(dp=2)
    found = compare([torch.ones(3), torch.ones(3) * 1.01], torch.ones(3), 0.0, layout, {"dp": R})
    assert found.max_abs == 0.0 and found.replica_mismatch == {"dp": pytest.approx(0.01)}
    assert not found.ok


def test_unknown_placements_are_inferred_but_never_partial_when_replicas_agree():
    layout = Layout(tp=2)
    full = torch.arange(6.0).reshape(2, 3)
    found = compare(list(full.chunk(2, 0)), full, 0.0, layout, {})
    assert found.placements == {"tp": S(0)} and found.inferred == {"tp"} and found.ok
    halves = [full / 2, full / 2]  # equal halves: read as R, and so a mismatch, never as P
    found = compare(halves, full, 0.0, layout, {})
    assert found.placements == {"tp": R} and not found.ok
    partial = [full - 1, torch.ones(2, 3)]
    assert compare(partial, full, 0.0, layout, {}).placements == {"tp": P}


def test_values_without_a_global_meaning_are_not_comparable():
    layout = Layout(tp=2)
    with pytest.raises(NotComparable, match="V"):
        compare([torch.ones(2), torch.ones(2)], torch.ones(2), 0.0, layout, {"tp": V})
    with pytest.raises(NotComparable, match="cannot make the reference shape"):
        compare([torch.ones(3), torch.ones(3)], torch.ones(5), 0.0, layout, {})
