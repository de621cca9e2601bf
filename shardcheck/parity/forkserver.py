"""Ranks forked from a warm interpreter: a server imports the heavy modules once (torch,
megatron-core) and starts each rank as a fork of itself, which then runs its module or script
as ``python -m MODULE`` or ``python SCRIPT`` would. A rank so skips the seconds every fresh
interpreter spends importing.

The server is started with the ranks' interpreter environment (``PYTHONPATH``, warnings,
threads), and :func:`server_for` keeps one per environment for the life of this process.
Run as ``python .../forkserver.py MODULE...`` (this file alone: the server imports nothing of
shardcheck, so a rank sees only what it imports itself and the preloaded modules), it reads
one JSON request per line on stdin and answers on stdout: ``{"pid": N}`` per started rank,
``{"exited": N, "code": C}`` when rank N ends (C as :attr:`subprocess.Popen.returncode`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path

# Read by the interpreter at its start, so a server serves only ranks that agree on them.
STARTUP_VARIABLES = ("PYTHONPATH", "PYTHONWARNINGS", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
                     "OMP_NUM_THREADS", "MKL_NUM_THREADS")
POLL_SECONDS = 0.05
# Servers kept warm at once: each holds its preloaded modules (hundreds of MB with megatron-core).
WARM_SERVERS = 4


class ServerFailed(RuntimeError):
    """The server could not import its modules or stopped answering."""


class ForkServer:
    """A warm interpreter that forks ranks on request (the client side)."""

    def __init__(self, modules: Sequence[str], env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, *modules], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, start_new_session=True, bufsize=0)
        self._lock = threading.Lock()
        self._codes: dict[int, int] = {}
        self._running: set[int] = set()
        ready = self._message()
        if ready.get("ready") is not True:
            self.close()
            raise ServerFailed(ready.get("error", "the fork server did not start"))

    def start(self, command: Sequence[str], env: dict[str, str], stdout: Path, stderr: Path) -> ForkedRank:
        """Fork a rank that runs ``command`` (``["-m", MODULE, *args]`` or ``[SCRIPT, *args]``,
        what follows ``python``) with ``env``; its output goes to the files ``stdout``, ``stderr``."""
        request = {"command": list(command), "env": env, "cwd": os.getcwd(),
                   "stdout": str(stdout), "stderr": str(stderr)}
        with self._lock:
            _write_all(self._proc.stdin.fileno(), json.dumps(request).encode() + b"\n")
            while True:
                message = self._message()
                if "pid" in message:
                    self._running.add(message["pid"])
                    return ForkedRank(self, message["pid"])
                self._note(message)

    def returncode(self, pid: int, block: bool) -> int | None:
        """Rank ``pid``'s exit code once it ended; None while it runs (with ``block``, wait)."""
        with self._lock:
            while pid not in self._codes:
                if not block and not select.select([self._proc.stdout], [], [], 0)[0]:
                    return None
                self._note(self._message())
            return self._codes[pid]

    @property
    def idle(self) -> bool:
        """No rank it started is still running (as far as its answers read so far tell)."""
        return not self._running

    def close(self) -> None:
        """Stop the server; it kills the ranks still running."""
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def _note(self, message: dict) -> None:
        self._codes[message["exited"]] = message["code"]
        self._running.discard(message["exited"])

    def _message(self) -> dict:
        line = self._proc.stdout.readline()  # unbuffered: select sees every line not yet read
        if not line:
            raise ServerFailed(f"the fork server stopped (exit code {self._proc.wait()})")
        return json.loads(line)


class ForkedRank:
    """One forked rank, waited on like a :class:`subprocess.Popen`."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid

    def poll(self) -> int | None:
        return self.server.returncode(self.pid, block=False)

    def wait(self) -> int:
        return self.server.returncode(self.pid, block=True)


_SERVERS: dict[tuple, ForkServer] = {}


def server_for(modules: Sequence[str], env: dict[str, str]) -> ForkServer:
    """The running server with ``modules`` imported under ``env``'s startup variables (one is
    started on first use, and stopped when this process exits). At most :data:`WARM_SERVERS`
    are kept: a new one first stops the least recently used idle ones."""
    startup = {name: env[name] for name in STARTUP_VARIABLES if name in env}
    key = (tuple(modules), tuple(sorted(startup.items())))
    if key in _SERVERS:
        _SERVERS[key] = _SERVERS.pop(key)  # most recently used last
        return _SERVERS[key]
    if not _SERVERS:
        atexit.register(close_servers)
    for old in [k for k, server in _SERVERS.items() if server.idle][:max(0, len(_SERVERS) + 1 - WARM_SERVERS)]:
        _SERVERS.pop(old).close()
    _SERVERS[key] = ForkServer(modules, {**os.environ, **startup})
    return _SERVERS[key]


def close_servers() -> None:
    """Stop every server this process started."""
    while _SERVERS:
        _SERVERS.popitem()[1].close()


def kill_session(pid: int) -> None:
    """Kill a rank that leads its own session and all it started (the rank itself even before
    its ``setsid``); nothing when it has ended."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)


def _serve(modules: Sequence[str]) -> None:
    """The server's loop: import ``modules``, then fork a rank per request until stdin closes."""
    die_with_parent()
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  (any import failure is the client's one line)
        _answer({"error": f"cannot import {module}: {type(exc).__name__}: {exc}"})
        return
    _answer({"ready": True})
    children: set[int] = set()
    stdin = sys.stdin.buffer
    while True:
        if select.select([stdin], [], [], POLL_SECONDS)[0]:
            line = stdin.readline()
            if not line:
                break
            pid = os.fork()
            if pid == 0:
                _run_rank(json.loads(line))
            children.add(pid)
            _answer({"pid": pid})
        _reap(children)
    for pid in children:
        kill_session(pid)
        os.waitpid(pid, 0)
    os._exit(0)  # no interpreter teardown of the preloaded modules: it took seconds a server


def _reap(children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            _answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _answer(message: dict) -> None:
    _write_all(1, json.dumps(message).encode() + b"\n")


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _run_rank(request: dict) -> None:
    """In the forked child: become the rank ``python COMMAND`` would start, run it, exit."""
    os.setsid()
    die_with_parent()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    code = 0
    try:
        _run_command(request["command"], request["cwd"])
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001  (as the interpreter does: print it, exit 1)
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(code)


def _run_command(command: list[str], cwd: str) -> None:
    """Run ``python COMMAND`` in this interpreter: ``-m MODULE ARGS`` or ``SCRIPT ARGS``."""
    if command[0] == "-m":
        sys.path.insert(0, cwd)  # `python -m` puts the working directory first
        sys.argv = command[1:]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))  # as `python SCRIPT` does
        sys.argv = list(command)
        runpy.run_path(command[0], run_name="__main__")


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    del sys.path[0]  # this file's folder: the ranks' paths are those of `python -m` or a script
    _serve(sys.argv[1:])
