"""Start real Gloo ranks on this machine and collect what each one returns."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


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


def _rank_main(fn, rank, world_size, port, args, queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, True, fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        try:
            queue.put((rank, False, (exc, traceback.format_exc())))
        except Exception:  # the exception itself does not pickle
            queue.put((rank, False, (None, traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` forked Gloo ranks; return the per-rank results.

    The first failing rank is raised as :class:`RankFailure`. Ranks still running after
    ``timeout`` seconds (a hang) are killed and ``TimeoutError`` is raised.
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
                rank, ok, payload = queue.get(timeout=timeout)
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
