"""Rank pools whose ranks run megatron-core on Transformer Engine's layers (the audit's ``impl=te``).

megatron-core decides whether it has Transformer Engine when each of its modules is first
imported, and the audit's own process imported it without TE (its warm pools fork from it). So
the TE pools live in a host process of their own: a fresh interpreter that installs TE's CPU
layer (:data:`~shardcheck.megatron.cpu.TE_PRELOAD`) before it imports megatron-core, then keeps
one :class:`~shardcheck.parity.pool.RankPool` per world size and runs the audit's jobs on them.
Jobs and results travel pickled over two pipes (by value, as the pools' own do); a failed job comes back as the
:class:`~shardcheck.parity.pool.PoolFailure` the host's pool raised.

Run as ``python -m shardcheck.megatron.audit.hosted READ_FD WRITE_FD TIMEOUT MODULE...``; this
module imports nothing of megatron-core itself, so the host's imports decide what TE it sees.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from shardcheck.parity import transport
from shardcheck.parity.layout import Layout
from shardcheck.parity.pool import PoolFailure

# The audit's sys.path, which the host takes before it imports TE and megatron-core: the same
# megatron-core (a --megatron tree first), not one that `python -m` finds in the working folder.
PATH_ENV = "SHARDCHECK_TE_HOST_PATH"


class TEHost:
    """The client side: a host process started on first use, closed with :meth:`close`."""

    def __init__(self, timeout: float, preload: Sequence[str]) -> None:
        self.timeout = timeout
        self.preload = tuple(preload)
        self._proc: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._recv: Connection | None = None

    def _start(self) -> None:
        to_host, from_parent = os.pipe()
        to_parent, from_host = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(to_host), str(from_host), str(self.timeout),
             *self.preload], pass_fds=(to_host, from_host), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, PATH_ENV: os.pathsep.join(sys.path)})
        os.close(to_host)
        os.close(from_host)
        self._send = Connection(from_parent, readable=False)
        self._recv = Connection(to_parent, writable=False)

    def run(self, layout: Layout, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(ctx, *args)`` on the host's pool of ``layout.world_size`` ranks; PoolFailure
        when it fails there (or the host cannot start: TE or megatron-core does not import)."""
        if self._proc is None:
            self._start()
        assert self._send is not None and self._recv is not None
        try:
            self._send.send_bytes(transport.dumps((layout, fn, args)))
            ok, payload = transport.loads(self._recv.recv_bytes())
        except (EOFError, OSError):
            code = self.close()
            raise PoolFailure("error", f"the Transformer Engine pool's host stopped (exit code {code})") from None
        if ok:
            return payload
        raise PoolFailure(*payload)

    def close(self) -> int | None:
        """Stop the host (its pools' ranks die with it); its exit code, None if never started."""
        if self._proc is None:
            return None
        for end in (self._send, self._recv):
            if end is not None:
                end.close()
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        self._proc = self._send = self._recv = None
        return code


def _serve(read_fd: int, write_fd: int, timeout: float, modules: Sequence[str]) -> None:
    """The host's loop: install TE, import ``modules``, then run each job received until the
    parent closes its end; a job's failure (or the imports') goes back as PoolFailure fields."""
    from shardcheck.megatron.cpu import TE_PRELOAD
    from shardcheck.parity.forkserver import die_with_parent
    from shardcheck.parity.pool import RankPool

    die_with_parent()
    jobs, answers = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    broken = None
    try:
        for module in (TE_PRELOAD, *modules):
            importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - every job is then answered with this line
        broken = f"cannot import {module} for Transformer Engine ranks: {type(exc).__name__}: {exc}"
    pools: dict[int, RankPool] = {}
    while True:
        try:
            layout, fn, args = transport.loads(jobs.recv_bytes())
        except EOFError:
            break
        if broken:
            reply: tuple = (False, ("error", broken))
        else:
            if layout.world_size not in pools:
                pools[layout.world_size] = RankPool(layout.world_size, timeout=timeout)
            try:
                reply = (True, pools[layout.world_size].run(layout, fn, *args))
            except PoolFailure as failure:
                reply = (False, (failure.kind, str(failure), failure.tracebacks, failure.last_collectives))
        answers.send_bytes(transport.dumps(reply))
    for pool in pools.values():
        pool.close()
    os._exit(0)  # no interpreter teardown of the preloaded modules


if __name__ == "__main__":
    sys.path[:] = os.environ.pop(PATH_ENV, os.pathsep.join(sys.path)).split(os.pathsep)
    _serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:])
