"""Start real local ranks: forked Gloo ranks that return values (:func:`spawn_ranks`), and
torchrun-style script launches that report checker findings (:func:`run_script`)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardcheck.parity.forkserver import (
    ForkedRank,
    ForkServer,
    ServerFailed,
    die_with_parent,
    kill_session,
    server_for,
)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RankFailure(Exception):
    """A rank raised: its number, the exception (when picklable) and its formatted traceback."""

    rank: int
    error: BaseException | None
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank} failed:\n{self.traceback}"


def join_gloo(rank: int, world_size: int, port: int) -> dist.TCPStore:
    """Join the Gloo world whose store rank 0 serves at ``port``, and return its store once
    every rank has joined.

    Until then no rank starts its work, so none exits while a peer still connects to it: a
    peer gone mid-connect fails Gloo's connectFullMesh ("Connection closed by peer") or leaves
    it waiting, as ranks with nothing to send did on a loaded machine. The rank's environment
    is torchrun's (``RANK``, ``MASTER_PORT``, ...), for the code it runs.
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    _arrive(store, "joined", world_size, wait=True)
    return store


def _arrive(store: dist.TCPStore, point: str, world_size: int, wait: bool) -> None:
    """Count this rank in at ``point``; with ``wait``, return once every rank is there."""
    if store.add(f"shardcheck/{point}", 1) == world_size:
        store.set(f"shardcheck/all {point}", "")
    if wait:
        store.wait([f"shardcheck/all {point}"])


def _rank_main(fn, rank, world_size, port, args, queue) -> None:
    store, done = None, False
    try:
        store = join_gloo(rank, world_size, port)
        queue.put(_by_value((rank, True, fn(*args))))
        done = True
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        try:
            queue.put(_by_value((rank, False, (exc, traceback.format_exc()))))
        except Exception:  # the exception itself does not pickle
            queue.put(_by_value((rank, False, (None, traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if store is not None:
            with contextlib.suppress(RuntimeError):  # the store went with a failed rank 0
                _leave(store, rank, world_size, done)


def _leave(store: dist.TCPStore, rank: int, world_size: int, finished: bool) -> None:
    """Leave the world together. A rank that finished waits until every rank is done, as its
    peers may still connect sub-groups to it, through the store rank 0 serves; rank 0 then
    waits until the others have seen that, so that its store outlives their last use of it.
    A rank that failed leaves at once: its exit ends the collectives its peers wait in."""
    _arrive(store, "left", world_size, wait=finished)
    if rank:
        _arrive(store, "released", world_size - 1, wait=False)
    elif finished and world_size > 1:
        store.wait(["shardcheck/all released"])


def _by_value(payload: Any) -> bytes:
    """Pickle tensors by value: torch's queue reducers would pass shared memory that dies with the rank."""
    return pickle.dumps(payload)


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` forked Gloo ranks; return the per-rank results.

    The first failing rank is raised as :class:`RankFailure`. Ranks still running after
    ``timeout`` seconds (a hang) are killed and ``TimeoutError`` is raised. Ranks are forked:
    call it before the parent runs an OpenMP-parallel kernel, or with one intra-op thread.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, queue), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = pickle.loads(queue.get(timeout=timeout))
            except Exception as exc:
                missing = sorted(set(range(world_size)) - set(results) - {f.rank for f in failures})
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s") from exc
            if ok:
                results[rank] = payload
            else:
                failures.append(RankFailure(rank, *payload))
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise min(failures, key=lambda f: f.rank)
    return [results[r] for r in range(world_size)]


_FOLLOW_ON = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crash"
                        r"|Broken pipe|ProcessGroupGloo.*(?:closed|terminated)")


def first_failures(outputs: dict[int, str]) -> list[tuple[int, str]]:
    """Failing ranks' outputs (in the order they failed), those that failed on their own first:
    a rank whose error only says a peer went away (Gloo's follow-on error) comes after them."""
    return sorted(outputs.items(), key=lambda item: bool(_FOLLOW_ON.search(item[1])))


CHECKER_LINE = re.compile(r"^\s*(?:[\w.]*SpmdTypeError: )?(checker: .*)$")
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ", re.MULTILINE)  # torch's excepthook prefixes tracebacks


@dataclass
class RankExit:
    """How one launched rank ended: its exit code (None when it hung) and its stderr."""

    rank: int
    returncode: int | None
    stderr: str
    ended: int = 0  # the order in which the ranks ended


@dataclass
class ScriptRun:
    """The outcome of :func:`run_script`: per-rank exits and the distinct checker lines."""

    ranks: list[RankExit]
    timeout: float

    @property
    def checker_lines(self) -> dict[str, list[int]]:
        """Each distinct ``checker:`` line on any rank's stderr, with the ranks that printed it."""
        found: dict[str, list[int]] = {}
        for rank in self.ranks:
            for line in rank.stderr.splitlines():
                match = CHECKER_LINE.match(line)
                if match and rank.rank not in found.setdefault(match.group(1), []):
                    found[match.group(1)].append(rank.rank)
        return found

    @property
    def failed(self) -> list[RankExit]:
        return [r for r in self.ranks if r.returncode != 0]

    @property
    def exit_code(self) -> int:
        """1 if the checker fired, 2 if a rank failed or hung otherwise, 0 when clean."""
        return 1 if self.checker_lines else 2 if self.failed else 0

    def report(self) -> str:
        here = os.getcwd() + os.sep  # paths under the working directory read better relative
        lines = [f"{line.replace(f' at {here}', ' at ')}  [ranks {', '.join(map(str, ranks))}]"
                 for line, ranks in self.checker_lines.items()]
        if not lines:
            by_rank = {rank.rank: rank for rank in sorted(self.failed, key=lambda r: r.ended)}
            for number, _ in first_failures({r: by_rank[r].stderr for r in by_rank}):
                rank = by_rank[number]
                what = f"hung: killed after {self.timeout:g} s" if rank.returncode is None else (
                    f"failed with exit code {rank.returncode}")
                lines.append(f"rank {rank.rank} {what}")
                lines += [f"  {line}" for line in rank.stderr.rstrip().splitlines()[-30:]]
        return "\n".join(lines)


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun --standalone gives rank ``rank`` of a one-node run."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "shardcheck"}


def _own_session() -> None:
    """In the child before exec: a session of its own (killed as a group), dying with the parent."""
    os.setsid()
    die_with_parent()


def _kill_group(proc: subprocess.Popen | ForkedRank) -> None:
    kill_session(proc.pid)
    proc.wait()


def run_script(script: str, args: Sequence[str], nproc: int, timeout: float,
               env: dict[str, str] | None = None, log_stdout: bool = False,
               preload: Sequence[str] = ()) -> ScriptRun:
    """Run ``python script args`` as ``nproc`` local ranks, like ``torchrun --standalone``.

    Each rank runs in its own session; ranks still running after ``timeout`` seconds are
    killed with everything they started, and so is every rank if this call is interrupted.
    ``env`` is added to each rank's environment; ``log_stdout`` sends its stdout to its log
    (the stderr kept in :class:`RankExit`) instead of this process's stdout, where the ranks'
    lines are otherwise passed on whole (never two ranks' text on one line). With ``preload``
    (and ``log_stdout``), the ranks are forked from a server that imported those modules once
    (:mod:`shardcheck.parity.forkserver`) instead of being fresh interpreters.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="shardcheck-run-") as tmp:
        logs = [open(Path(tmp) / f"rank{r}.err", "w+") for r in range(nproc)]  # noqa: SIM115
        server = _fork_server(preload, env) if preload and log_stdout else None
        procs: list[Any] = []
        relays: list[threading.Thread] = []
        try:
            for rank in range(nproc):
                rank_env = {**os.environ, **(env or {}), **torchrun_env(rank, nproc, port)}
                if server is not None:
                    log = Path(logs[rank].name)
                    procs.append(server.start([script, *args], rank_env, stdout=log, stderr=log))
                    continue
                procs.append(subprocess.Popen(
                    [sys.executable, script, *args], stderr=logs[rank], preexec_fn=_own_session,
                    stdout=logs[rank] if log_stdout else subprocess.PIPE, env=rank_env))
                if not log_stdout:
                    relays.append(_relay_lines(procs[-1].stdout))
            codes, order = _wait_all(procs, timeout)
        finally:
            for proc in procs:
                _kill_group(proc)
            for relay in relays:
                relay.join(timeout=5)
        ranks = []
        for rank, log in enumerate(logs):
            log.seek(0)
            ranks.append(RankExit(rank, codes[rank], RANK_PREFIX.sub("", log.read()), order[rank]))
            log.close()
    return ScriptRun(ranks, timeout)


def _fork_server(modules: Sequence[str], env: dict[str, str] | None) -> ForkServer | None:
    """A warm server for the ranks' interpreter settings; None (fresh interpreters) when it
    cannot import ``modules``: then the ranks themselves report why."""
    try:
        return server_for(modules, {**os.environ, **(env or {})})
    except ServerFailed:
        return None


_STDOUT_LOCK = threading.Lock()


def _relay_lines(stream) -> threading.Thread:
    """Copy a rank's stdout to our stdout's file descriptor (which the rank would otherwise
    inherit) line by line, one whole line at a time."""
    def relay() -> None:
        with stream:
            for line in iter(stream.readline, b""):
                with _STDOUT_LOCK:
                    while line:
                        line = line[os.write(1, line):]

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return thread


def _wait_all(procs: list[subprocess.Popen | ForkedRank], timeout: float) -> tuple[list[int | None], list[int]]:
    """Exit codes once every rank ended (None for those still running at the deadline), and
    the order in which they ended (ranks still running last)."""
    deadline, ended = time.monotonic() + timeout, {}
    while time.monotonic() < deadline and len(ended) < len(procs):
        for rank, proc in enumerate(procs):
            if rank not in ended and _has_ended(proc):
                ended[rank] = len(ended)
        time.sleep(0.02)
    codes = [proc.wait() if rank in ended else None for rank, proc in enumerate(procs)]
    return codes, [ended.get(r, len(procs)) for r in range(len(procs))]


def _has_ended(proc: subprocess.Popen | ForkedRank) -> bool:
    """Whether a rank has exited, without reaping it. Not ``Popen.poll``: a Ctrl-C that lands
    inside it can leave its lock taken, and the ``wait`` that kills the ranks then never returns."""
    if isinstance(proc, ForkedRank):
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


