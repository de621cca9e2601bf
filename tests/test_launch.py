import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from shardcheck.parity.launch import RankFailure, _wait_all, spawn_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on one")
    return 0


def test_spawn_ranks_runs_real_gloo_collectives():
    assert spawn_ranks(_sum_of_ranks, 4) == [6.0] * 4


def test_spawn_ranks_reports_the_failing_rank():
    with pytest.raises(RankFailure) as info:
        spawn_ranks(_rank_one_raises, 2)
    assert info.value.rank == 1 and isinstance(info.value.error, ValueError)
    assert "boom on one" in info.value.traceback


def _rank_tensor():
    return torch.full((3,), float(dist.get_rank()))


def test_spawn_ranks_returns_tensors_by_value():
    first, second = spawn_ranks(_rank_tensor, 2)
    assert torch.equal(first, torch.zeros(3)) and torch.equal(second, torch.ones(3))


def _late_sub_group():
    """Rank 0 is done at once; ranks 1 and 2 build a group of their own a second later, through
    the store that rank 0's process serves."""
    if dist.get_rank() == 0:
        dist.new_group([1, 2])
        return 0.0
    time.sleep(1)
    group = dist.new_group([1, 2])
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=group)
    return t.item()


def test_a_rank_done_early_waits_for_its_peers_to_finish():
    assert spawn_ranks(_late_sub_group, 3, timeout=60) == [0.0, 3.0, 3.0]


def test_waiting_on_ranks_never_calls_popen_poll_and_leaves_the_exit_codes(monkeypatch):
    """A Ctrl-C landing inside ``Popen.poll`` can leave its lock taken, and the ``wait`` that then
    kills the ranks never returns (seen once: a launcher hung after Ctrl-C): the wait loop checks
    for an exit without ``poll`` and without reaping, so ``wait`` still reads each code."""
    def no_poll(self):
        raise AssertionError("Popen.poll called")

    procs = [subprocess.Popen([sys.executable, "-c", f"import sys, time; time.sleep({delay}); sys.exit({code})"])
             for delay, code in ((0.5, 3), (0, 0))]
    monkeypatch.setattr(subprocess.Popen, "poll", no_poll)
    codes, order = _wait_all(procs, timeout=60)
    assert codes == [3, 0] and order == [1, 0]
