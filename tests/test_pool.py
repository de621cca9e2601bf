import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardcheck.parity.pool import PoolFailure, RankPool


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (read from /proc, no psutil)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def interruptible() -> None:
    """In a child before exec: Ctrl-C (SIGINT) handled as a terminal gives it, even when this
    test runs in the background of a non-interactive shell, which starts it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_gone(pids, seconds=60.0) -> list[int]:
    """The pids still alive after up to ``seconds`` (returns as soon as none is: generous for a
    loaded machine, free on an idle one)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _tp_sum(ctx, value):
    t = torch.tensor([value * (ctx.rank + 1)])
    dist.all_reduce(t, group=ctx.groups["tp"])
    return (ctx.rank, ctx.world_size, t.item())


def _many_tensors(ctx, count):
    return [torch.full((3,), float(i)) for i in range(count)]


def test_results_with_thousands_of_tensors_come_back_by_value():
    """Each tensor sent by torch's reducers would hold a file descriptor of its own."""
    import resource

    count = resource.getrlimit(resource.RLIMIT_NOFILE)[0] + 100
    with RankPool(1, timeout=60, checker=False) as pool:
        [result] = pool.run("tp1", _many_tensors, count)
    assert len(result) == count and result[-1].tolist() == [count - 1.0] * 3


def _rank_one_raises(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on rank one")
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.groups["tp"])  # rank 0 waits for a partner that is gone
    return t.item()


def _extra_collective_on_rank_zero(ctx):
    t = torch.ones(3)
    dist.all_reduce(t, group=ctx.groups["tp"])
    if ctx.rank == 0:
        dist.all_reduce(t, group=ctx.groups["tp"])
    return t.tolist()


def _ranks_disagree_on_the_collective(ctx):
    t = torch.ones(4)
    if ctx.rank == 0:
        dist.all_reduce(t, group=ctx.groups["tp"])
    else:
        dist.broadcast(t, src=0, group=ctx.groups["tp"])
    return t.tolist()


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, timeout=20, grace=0.5, checker=False) as warm:
        yield warm


def test_pool_runs_many_layouts_on_sub_groups_of_one_world(pool):
    pids = pool.pids
    assert pool.run("tp2", _tp_sum, 1.0) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert pool.run("tp2-dp2", _tp_sum, 2.0) == [(0, 4, 6.0), (1, 4, 6.0), (2, 4, 14.0), (3, 4, 14.0)]
    assert pool.run("dp2", _tp_sum, 1.0) == [(0, 2, 1.0), (1, 2, 2.0)]
    assert pool.run("tp1", _tp_sum, 5.0) == [(0, 1, 5.0)]
    assert pool.pids == pids, "the warm workers were reused"


def _pipeline_exchange(ctx):
    """Send this stage's rank to the other pipeline stage with P2POps, as Megatron's schedules do."""
    ranks = ctx.layout.partition("pp")[0]
    other = ranks[1 - ranks.index(ctx.rank)]
    out, received = torch.tensor([float(ctx.rank)]), torch.zeros(1)
    ops = [dist.P2POp(dist.isend, out, other), dist.P2POp(dist.irecv, received, other)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received.item()


def test_point_to_point_ops_accept_the_logged_isend_and_irecv(pool):
    assert pool.run("pp2", _pipeline_exchange) == [1.0, 0.0]


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (its threads' children, read from /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return {c for c in found if alive(c)}


def _whoami(ctx):
    return ctx.rank, os.getpid(), os.getppid(), children(os.getpid())


def test_a_warm_run_reuses_the_forked_ranks_and_forks_nothing(pool):
    """The speed of a warm run (bench/pool_latency.py measures it against torchrun) comes from
    this: every job runs in the ranks forked at start, and no process is started for it."""
    pool.run("tp2", _tp_sum, 1.0)
    pids, before = pool.pids, children(os.getpid())
    assert set(pids) <= before
    runs = [pool.run(layout, _whoami) for layout in ("tp2", "tp2", "tp2-dp2", "tp1")]
    for run in runs:
        assert [(rank, pid, parent, grandchildren) for rank, pid, parent, grandchildren in run] == [
            (rank, pids[rank], os.getpid(), set()) for rank in range(len(run))]
    assert pool.pids == pids and children(os.getpid()) == before


def test_a_rank_that_raises_is_reported_and_the_pool_keeps_serving(pool):
    old = pool.pids
    with pytest.raises(PoolFailure) as info:
        pool.run("tp2", _rank_one_raises, timeout=10)
    failure = info.value
    assert failure.kind == "error" and set(failure.tracebacks) == {1}
    assert "rank 1 raised" in str(failure) and "ValueError: boom on rank one" in str(failure)
    assert "in _rank_one_raises" in failure.tracebacks[1] and "shardcheck/parity/pool.py" not in failure.tracebacks[1]
    assert "rank 0: #1 all_reduce(float32[1]) on group [0, 1]; rank 1: no collective entered (raised)" in str(failure)
    assert pool.run("tp2", _tp_sum, 1.0) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert wait_gone(set(old) - set(pool.pids)) == [], "rank 0 was left waiting: the pool restarted"


def test_a_hang_reports_the_last_collective_and_restarts_the_pool(pool):
    old = pool.pids
    with pytest.raises(PoolFailure) as info:
        pool.run("tp2", _extra_collective_on_rank_zero, timeout=2)
    failure = info.value
    assert failure.kind == "hang"
    assert failure.last_collectives == {0: "#2 all_reduce(float32[3]) on group [0, 1]",
                                        1: "#1 all_reduce(float32[3]) on group [0, 1]"}
    assert "ranks [0] did not finish within 2 s" in str(failure)
    assert wait_gone(old) == [] and set(pool.pids).isdisjoint(old)
    assert pool.run("tp2", _tp_sum, 1.0) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_a_desync_is_reported_as_a_desync(pool):
    old = pool.pids
    with pytest.raises(PoolFailure) as info:
        pool.run("tp2", _ranks_disagree_on_the_collective, timeout=2)
    assert info.value.kind == "desync"
    assert str(info.value).startswith(
        "desync on group [0, 1] at its collective #1: rank 0: all_reduce(float32[4]); "
        "rank 1: broadcast(float32[4])")
    pool.run("tp2", _tp_sum, 1.0)
    assert wait_gone(set(old) - set(pool.pids)) == []


def test_closing_the_pool_leaves_no_worker():
    with RankPool(2, timeout=20, checker=False) as small:
        pids = small.pids
        assert all(alive(p) for p in pids)
    assert wait_gone(pids) == []


_PARENT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from shardcheck.parity.pool import RankPool

    def stuck(ctx):
        if ctx.rank == 0:
            dist.all_reduce(torch.ones(1), group=ctx.groups["tp"])
        return 0

    pool = RankPool(2, timeout=600, checker=False)
    print(" ".join(map(str, pool.pids)), flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("parent failed")
    pool.run("tp2", stuck)
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigint", "sigkill", "raise"])
def test_parent_interrupt_kill_or_exception_leaves_no_process(how, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env, preexec_fn=interruptible)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    if how != "raise":  # a raising parent may already have stopped its ranks by now
        assert all(alive(p) for p in pids)
        time.sleep(0.5)  # the parent is now waiting on the stuck job
        parent.send_signal(signal.SIGINT if how == "sigint" else signal.SIGKILL)
    assert parent.wait(timeout=120) != 0
    assert wait_gone(pids) == []
