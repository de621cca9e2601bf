"""Self-contained reproduction scripts for findings, and running them under torchrun.

A target describes its script with a :class:`ScriptBody`: the imports of the library under
test and code defining ``observed()`` (run on every rank), ``reference()`` (the right value) and
optionally ``corrected()`` (the value with the fix applied). The template around it starts Gloo,
prints ``observed:``, ``reference:``, ``corrected:`` and ``checker:`` lines and ``REPRODUCED
<name>``, and exits 0 while the bug reproduces and 1 once observed matches reference. The
generated script imports nothing from shardcheck.
"""

from __future__ import annotations

import os
import pprint
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from shardcheck.fuzz.findings import TYPE_ONLY, Finding
from shardcheck.parity.forkserver import ForkServer, kill_session, server_for
from shardcheck.parity.launch import free_port

REPRODUCES, FIXED, BROKEN = "reproduces", "fixed", "error"


@dataclass(frozen=True)
class ScriptBody:
    """The target-specific part of a repro script (see the module docstring)."""

    code: str
    imports: str = ""
    has_corrected: bool = False
    support: str = ""  # code the finding does not change (helpers, CPU stand-ins), after its own
    sys_path: tuple[str, ...] = field(default=())
    preamble: str = ""  # code run before the library's imports (Transformer Engine's CPU layer)


_TEMPLATE = Template('''\
"""$title

Finding $id: $contract
Location: $location
Trigger: layout $layout, config $config_inline
Run: torchrun --standalone --nproc-per-node=$world $filename
Exits 0 while the bug reproduces, 1 once it is fixed.
"""

from __future__ import annotations

$stdlib_imports$sys_path$preamble
import torch
import torch.distributed as dist
$imports

NAME = "$name"
CONFIG = $config
RTOL, ATOL = 1e-4, 1e-6
CHECKER = $checker


$code
$support

def show(value):
    flat = value.detach().double().flatten()
    return ", ".join(f"{x:.7g}" for x in flat[:8].tolist()) + (", ..." if flat.numel() > 8 else "")


def farthest(got, want):
    """The entry where observed and reference are farthest apart, for a value too long to show."""
    gap = (got.double() - want.double()).abs().flatten()
    i = int(gap.argmax())
    return f"differs most at entry {i}: observed {got.flatten()[i].item():.7g}, reference {want.flatten()[i].item():.7g}"


def differs(got, want):
    """Whether observed and reference differ on any rank (the answer is the same on all ranks)."""
    bad = got.shape != want.shape or not torch.allclose(got.double(), want.double(), RTOL, ATOL)
    flag = torch.tensor([float(bad)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main():
    dist.init_process_group("gloo")
    want, got = reference(), observed()
$corrected_call
    reproduces = differs(got, want)
    if dist.get_rank() == 0:
        print(f"observed:  {show(got)}")
        print(f"reference: {show(want)}")
        if reproduces and got.shape == want.shape and got.numel() > 8:
            print(farthest(got, want))
$corrected_print
        if reproduces and CHECKER:
            print(CHECKER)
        print(f"REPRODUCED {NAME}" if reproduces else f"FIXED {NAME}: observed matches reference")
    dist.destroy_process_group()
    return 0 if reproduces else 1


if __name__ == "__main__":
    sys.exit(main())
''')


def render_script(finding: Finding, body: ScriptBody, filename: str = "repro.py") -> str:
    """The full script for ``finding`` around the target's ``body``."""
    sys_path = "".join(f"sys.path.insert(0, {p!r})  # the library under test\n" for p in body.sys_path)
    lines = [line for line in body.imports.strip().splitlines() if line.strip()]
    stdlib = [line for line in lines if line.startswith("import ") and "." not in line and line != "import torch"]
    library = [line for line in lines if line not in stdlib]
    return _TEMPLATE.substitute(
        title=finding.title, id=finding.id, contract=finding.contract, location=finding.location,
        layout=finding.layout, config_inline=finding.config, world=finding.world_size,
        filename=filename, sys_path=sys_path.rstrip("\n"), imports="\n".join(library),
        preamble=f"\n{body.preamble.strip()}" if body.preamble else "",
        stdlib_imports="".join(f"{line}\n" for line in sorted({"import sys", *stdlib})),
        name=finding.id, config=pprint.pformat(finding.config, width=90, sort_dicts=False),
        checker=repr(_checker_line(finding.checker)), code=body.code.strip() + "\n",
        support=f"\n{SUPPORT_HEADER}\n\n\n{body.support.strip()}\n\n" if body.support else "",
        corrected_call="    fixed = corrected()" if body.has_corrected else "",
        corrected_print='        print(f"corrected: {show(fixed)}")' if body.has_corrected else "",
    ).replace("\n\n\n\n", "\n\n\n")


def _checker_line(line: str | None) -> str | None:
    """The checker's line as the script prints it, recorded when the fuzzer found the bug."""
    if not line:
        return None
    return line if line.startswith("checker:") else f"checker: {line}"


SUPPORT_HEADER = "# ---- the same for every finding of this component: helpers, CPU stand-ins, the verdict ----"


class ReproError(ValueError):
    """A finding that cannot get a script; its message is one line for the user."""


def write_script(finding: Finding, body: Callable[[Finding], ScriptBody], path: Path | str) -> Path:
    """Write ``finding``'s script, around the code ``body(finding)`` gives, to ``path``."""
    if finding.kind == TYPE_ONLY:
        raise ReproError(f"finding {finding.id} is type-only: its numbers agree, so a script has "
                         "nothing to show; see its checker line")
    text = render_script(finding, body(finding), filename=Path(path).name)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@dataclass(frozen=True)
class ReproRun:
    """One run of a repro script: its status (reproduces / fixed / error) and its output."""

    status: str
    returncode: int
    output: str


def run_repro(path: Path | str, nproc: int, env: dict[str, str] | None = None,
              timeout: float = 300.0, launcher: str = "torchrun", args: tuple[str, ...] = (),
              preload: tuple[str, ...] = ()) -> ReproRun:
    """Run a repro script (with ``args``) on ``nproc`` ranks and tell whether it reproduces.

    ``launcher="torchrun"`` runs ``python -m torch.distributed.run --standalone``, as a user
    would; ``"direct"`` starts the ranks itself with the same environment variables, which skips
    torchrun's agent and is about twice as fast. With ``preload`` (direct only), the ranks are
    forked from a warm interpreter that imported those modules once
    (:mod:`shardcheck.parity.forkserver`); the script's own imports then find them loaded.
    """
    base = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if launcher == "torchrun":
        ranks = [([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", str(path), *args], base)]
    else:
        port = str(free_port())
        ranks = [([sys.executable, str(path), *args],
                  {**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
                 for r in range(nproc)]
    if preload and launcher != "torchrun":
        ended = _forked_outputs(server_for(preload, base), ranks, timeout)
    else:
        ended = _process_outputs(ranks, timeout)
    if ended is None:
        return ReproRun(BROKEN, -1, f"timed out after {timeout:.0f} s")
    returncode = next((code for code, _, _ in ended if code), 0)
    stdout = "".join(out for _, out, _ in ended)
    output = stdout + "".join(err for _, _, err in ended)
    if returncode == 0 and "REPRODUCED " in stdout:
        status = REPRODUCES
    elif returncode != 0 and "FIXED " in stdout:
        status = FIXED
    else:
        status = BROKEN
    return ReproRun(status, returncode, output)


Ended = list[tuple[int, str, str]]  # per process: exit code, stdout, stderr


def _process_outputs(ranks: list[tuple[list[str], dict[str, str]]], timeout: float) -> Ended | None:
    """Each command's exit code and output, run as its own process; None after ``timeout``."""
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=rank_env, start_new_session=True) for command, rank_env in ranks]
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=max(deadline - time.monotonic(), 0.1)))
    except subprocess.TimeoutExpired:
        for process in processes:  # each rank (or torchrun and its ranks) has its own session
            kill_session(process.pid)
            process.communicate()
        return None
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs, strict=True)]


def _forked_outputs(server: ForkServer, ranks: list[tuple[list[str], dict[str, str]]],
                    timeout: float) -> Ended | None:
    """As :func:`_process_outputs`, each rank forked from ``server``."""
    with tempfile.TemporaryDirectory(prefix="shardcheck-repro-") as folder:
        logs = [(Path(folder) / f"{n}.out", Path(folder) / f"{n}.err") for n in range(len(ranks))]
        forked = [server.start(command[1:], rank_env, out, err)
                  for (command, rank_env), (out, err) in zip(ranks, logs, strict=True)]
        deadline = time.monotonic() + timeout
        while (running := any(rank.poll() is None for rank in forked)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for rank in forked:  # each rank has its own session
            kill_session(rank.pid)
        codes = [rank.wait() for rank in forked]
        if running:
            return None
        return [(code, out.read_text() if out.exists() else "", err.read_text() if err.exists() else "")
                for code, (out, err) in zip(codes, logs, strict=True)]
