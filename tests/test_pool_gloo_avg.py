import torch
import torch.distributed as dist

from shardcheck.parity.gloo_avg import all_reduce_mean, avg_problems
from shardcheck.parity.launch import spawn_ranks
from shardcheck.parity.pool import RankPool


def _probe():
    sub = dist.new_group([1, 3])
    on_sub = avg_problems(sub) if dist.get_rank() in (1, 3) else []
    mean = all_reduce_mean(torch.tensor([float(dist.get_rank()), 1.0]))
    return avg_problems(), on_sub, mean.tolist(), _with_the_reported_bug()


def _with_the_reported_bug():
    """Replay #162338 (reduce-scatter AVG that sums) and check that the probe catches it."""
    original = dist.reduce_scatter_tensor

    def sums_instead(out, inp, op=None, group=None):
        return original(out, inp, op=dist.ReduceOp.SUM, group=group)

    dist.reduce_scatter_tensor = sums_instead
    try:
        return avg_problems()
    finally:
        dist.reduce_scatter_tensor = original


def test_torch_2_13_gloo_avg_matches_sum_then_divide_and_the_guard_is_exact():
    for world, sub, mean, buggy in spawn_ranks(_probe, 4):
        assert world == [] and sub == [], "torch's Gloo AVG is affected by pytorch #162338 here"
        assert mean == [1.5, 1.0]
        assert [p.split(":")[0] for p in buggy] == ["reduce_scatter_tensor AVG float32",
                                                   "reduce_scatter_tensor AVG float64"]


def test_the_pool_checks_avg_at_start():
    with RankPool(2, checker=False) as pool:
        assert pool.gloo_avg_problems == []
