"""A warm pool of forked Gloo ranks that runs many scenarios and layouts without restarting.

The parent imports torch (and any ``preload`` modules) and builds the type checker's tables
once, then forks ``world_size`` workers that join one Gloo world and wait for jobs. A job runs ``fn(ctx, *args)`` on the first
``layout.world_size`` workers, with ``ctx`` a :class:`~shardcheck.parity.scenario.ScenarioContext`
whose groups are sub-groups of that world (created once, cached by ranks).

Failures are reported as :class:`PoolFailure` with ``kind``:

* ``"error"``: ranks raised; their tracebacks with rank numbers. Ranks left waiting in a
  collective are stopped and the pool restarted; it keeps serving.
* ``"hang"``: ranks did not finish within the timeout; the last collective each rank entered
  is listed and the pool restarted.
* ``"desync"``: members of a group entered different collectives at the same position.

Workers die with the parent (``PR_SET_PDEATHSIG``) and :meth:`RankPool.close` kills them, so
Ctrl-C or an exception in the parent leaves no process behind.

Under ``torchrun`` (RANK and WORLD_SIZE set), :func:`run_in_place` runs a job on the existing
process group instead, NCCL and ``cuda`` when available, through the same :func:`run_on_rank`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.parity import collective_log, transport
from shardcheck.parity.forkserver import die_with_parent
from shardcheck.parity.gloo_avg import avg_problems
from shardcheck.parity.launch import first_failures, free_port, join_gloo
from shardcheck.parity.layout import Layout
from shardcheck.parity.scenario import ScenarioContext, active, build_groups
from shardcheck.typecheck.checker import typecheck
from shardcheck.typecheck.types import Mesh

Job = Callable[..., Any]


class PoolFailure(RuntimeError):
    """A job that failed on some ranks: ``kind`` is 'error', 'hang' or 'desync'."""

    def __init__(self, kind: str, message: str, tracebacks: dict[int, str] | None = None,
                 last_collectives: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.tracebacks = tracebacks or {}
        self.last_collectives = last_collectives or {}


def run_on_rank(fn: Job, layout: Layout, rank: int, device: torch.device | str, args: tuple) -> Any:
    """Build the groups of ``layout`` and run ``fn(ctx, *args)`` if this rank is in it (else None).

    Every rank of the world calls this, so that all of them create the groups in the same order.
    """
    groups = build_groups(layout, rank)
    if rank >= layout.world_size:
        return None
    ctx = ScenarioContext(layout, rank, groups, device)
    with active(ctx):
        return fn(ctx, *args)


def in_torchrun() -> bool:
    """True when this process was started by torchrun (or alike): RANK and WORLD_SIZE are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and not _IN_WORKER


def run_in_place(layout: Layout | str, fn: Job, *args: Any) -> list[Any] | None:
    """Run a job under the torchrun process group; rank 0 returns every rank's result, others None."""
    layout = Layout.coerce(layout)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(_destroy_group)  # ours to close: Gloo may abort at exit otherwise
    if layout.world_size > dist.get_world_size():
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks; torchrun started {dist.get_world_size()}")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    result = run_on_rank(fn, layout, rank, device, args)
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(_to_cpu(result), gathered, dst=0)
    return gathered[:layout.world_size] if rank == 0 else None


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


_IN_WORKER = False


def _worker_main(rank: int, world_size: int, port: int, conn: Connection, log_dir: str) -> None:
    global _IN_WORKER
    _IN_WORKER = True
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    join_gloo(rank, world_size, port)
    problems = avg_problems() if world_size > 1 else []
    collective_log.install()
    conn.send(("ready", problems))
    while (job := conn.recv()) is not None:
        fn, layout, args = job
        collective_log.LOG.restart(Path(log_dir) / f"rank{rank}.log")
        try:
            reply = (True, run_on_rank(fn, layout, rank, "cpu", args))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            reply = (False, _user_traceback(exc))
        try:  # by value: torch's reducers would pass each tensor as a shared-memory descriptor
            conn.send_bytes(transport.dumps(reply))
        except Exception:  # the result does not pickle
            conn.send_bytes(transport.dumps((False, traceback.format_exc())))


def warm_checker() -> None:
    """Build the type checker's op tables (seconds, once per process) so forked workers inherit them."""
    with contextlib.redirect_stderr(io.StringIO()), typecheck(Mesh(rank=0, tp=[0]), mode="collect"):
        torch.ones(2).add(1)


def _user_traceback(exc: BaseException) -> str:
    """The formatted traceback without the pool's own frames."""
    report = traceback.TracebackException.from_exception(exc)
    report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != __file__])
    return "".join(report.format())


class RankPool:
    """``world_size`` warm Gloo ranks; :meth:`run` runs a job on a layout's first ranks."""

    def __init__(self, world_size: int, timeout: float = 60.0, grace: float = 1.0,
                 preload: Iterable[str] = (), checker: bool = True) -> None:
        for module in preload:
            importlib.import_module(module)
        if checker:
            warm_checker()
        self.world_size = world_size
        self.timeout = timeout
        self.grace = grace
        self._log_dir = tempfile.TemporaryDirectory(prefix="shardcheck-pool-")
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self.gloo_avg_problems: list[str] = []
        atexit.register(self.close)
        self.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> None:
        """Fork the workers and wait until each one has joined the Gloo world."""
        ctx = mp.get_context("fork")
        port = free_port()
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, daemon=True,
                               args=(rank, self.world_size, port, child_end, self._log_dir.name))
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.timeout):
                self.close()
                raise PoolFailure("hang", f"rank {rank} did not join the Gloo world in {self.timeout:.0f} s")
            self.gloo_avg_problems = conn.recv()[1]
        if self.gloo_avg_problems:
            warnings.warn("Gloo AVG reductions are wrong here (pytorch #162338): "
                          + "; ".join(self.gloo_avg_problems) + ". Use SUM then divide.", stacklevel=2)

    def close(self) -> None:
        """Kill every worker and wait for it; the pool can be started again with :meth:`start`."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def restart(self) -> None:
        self.close()
        self.start()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
        self._log_dir.cleanup()
        atexit.unregister(self.close)

    def run(self, layout: Layout | str, fn: Job, *args: Any, timeout: float | None = None) -> list[Any]:
        """Run ``fn(ctx, *args)`` on ranks ``0..layout.world_size-1``; return their results in rank order."""
        layout = Layout.coerce(layout)
        if layout.world_size > self.world_size:
            raise ValueError(f"layout {layout} needs {layout.world_size} ranks; the pool has {self.world_size}")
        if not self._procs:
            self.start()
        ranks = list(range(self.world_size))  # all of them create the layout's groups
        try:
            for rank in ranks:
                self._conns[rank].send((fn, layout, args))
            results, errors, pending = self._collect(ranks, self.timeout if timeout is None else timeout)
        except BaseException:  # e.g. Ctrl-C: the workers are mid-job, so stop them
            self.close()
            raise
        logs = {r: collective_log.read(Path(self._log_dir.name) / f"rank{r}.log") for r in ranks}
        if pending or not all(p.is_alive() for p in self._procs):
            self.restart()
        desync = collective_log.find_desync(logs)
        if desync or pending or errors:
            users = range(layout.world_size)
            raise _failure(desync, errors, pending, collective_log.last_entered(logs, users), timeout or self.timeout)
        return [results[r] for r in range(layout.world_size)]

    def _collect(self, ranks: list[int], timeout: float) -> tuple[dict[int, Any], dict[int, str], list[int]]:
        """Wait for replies; after the first error, wait only ``grace`` seconds more."""
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = {self._conns[r]: r for r in ranks}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            for conn in wait(list(pending), timeout=max(left, 0)):
                rank = pending.pop(conn)
                try:
                    ok, payload = transport.loads(conn.recv_bytes())
                except EOFError:
                    ok, payload = False, f"rank {rank} died (exit code {self._procs[rank].exitcode})\n"
                (results if ok else errors)[rank] = payload
                if not ok:
                    deadline = min(deadline, time.monotonic() + self.grace)
            if time.monotonic() >= deadline:
                break
        return results, errors, sorted(pending.values())


def _failure(desync: str | None, errors: dict[int, str], pending: list[int],
             last: dict[int, str], timeout: float) -> PoolFailure:
    kind = "desync" if desync else "error" if errors else "hang"
    lines = [desync] if desync else []
    lines += [f"rank {rank} raised:\n{tb.rstrip()}" for rank, tb in first_failures(errors)]
    if pending:
        lines.append(f"hang: ranks {pending} did not finish within {timeout:g} s; the pool was restarted")
    state = {r: "" if r in pending else " (raised)" if r in errors else " (finished)" for r in last}
    lines.append("last collective entered: " + "; ".join(f"rank {r}: {what}{state[r]}" for r, what in last.items()))
    return PoolFailure(kind, "\n".join(lines), errors, last)
