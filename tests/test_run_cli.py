import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_pool import alive, interruptible, wait_gone

import shardcheck
from shardcheck.cli import main

HEADER = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
"""

SCRIPTS = {
    "clean": """
t = torch.tensor([float(rank)])
dist.all_reduce(t)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
line = " ".join(map(str, (rank, t.item(), sys.argv[1:], *(os.environ[k] for k in keys))))
os.write(1, (line + "\\n").encode())  # one write: the two ranks share stdout
dist.destroy_process_group()
""",
    "checker": """
import torch.nn.functional as F
import shardcheck as sc
with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):  # every violation, then go on
    partial = sc.annotate(torch.randn(2), tp=sc.P)
    F.gelu(partial)  # on both ranks
    if rank == 1:
        torch.exp(partial)  # on rank 1 only
""",
    "fails": """
if rank == 1:
    raise ValueError("rank one is broken")
""",
    "peer_fails": """
if rank == 1:
    raise ValueError("rank one broke first")
dist.all_reduce(torch.ones(1))  # rank 0 then fails here: its peer went away
""",
}


# Its processes are on record before torch is imported: under load, imports take seconds.
HANGS = """
import os, subprocess, sys, time
rank = int(os.environ["RANK"])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["PID_DIR"] + f"/{rank}", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if rank == 0:
    dist.all_reduce(torch.ones(1))
time.sleep(600)
"""


def _script(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(HANGS if name == "hangs" else HEADER + textwrap.dedent(SCRIPTS[name]))
    return str(path)


def _pids(pid_dir: Path, count: int, seconds: float = 180) -> list[int]:
    deadline = time.monotonic() + seconds
    while len(list(pid_dir.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    return [int(p) for f in pid_dir.iterdir() for p in f.read_text().split()]


CHATTY = """
import os, sys, time
for i in range(300):  # unbuffered: the text and its newline are two writes, apart in time
    sys.stdout.write(f"rank {os.environ['RANK']} line {i}")
    time.sleep(0.001)
    sys.stdout.write("\\n")
"""


def test_ranks_printing_at_once_give_whole_lines(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    result = CliRunner().invoke(main, ["run", "-n", "2", str(script)])
    assert result.exit_code == 0, result.output
    lines = capfd.readouterr().out.splitlines()
    expected = {f"rank {rank} line {i}" for rank in (0, 1) for i in range(300)}
    assert len(lines) == len(expected) and set(lines) == expected


@pytest.mark.slow
def test_clean_ranks_get_the_torchrun_environment_and_exit_0(tmp_path, capfd):
    result = CliRunner().invoke(main, ["run", "-n", "2", _script(tmp_path, "clean"), "--flag", "x"])
    out = capfd.readouterr().out
    assert result.exit_code == 0, result.output
    lines = sorted(line for line in out.splitlines() if line[:1].isdigit())
    assert lines[0].startswith("0 1.0 ['--flag', 'x'] 0 2 0 2 127.0.0.1 ")
    assert lines[1].startswith("1 1.0 ['--flag', 'x'] 1 2 1 2 127.0.0.1 ")


@pytest.mark.slow
def test_each_distinct_checker_line_is_printed_once_with_its_ranks(tmp_path):
    script = _script(tmp_path, "checker")
    lines = Path(script).read_text().splitlines()

    def line(code: str) -> int:
        return next(n for n, text in enumerate(lines, 1) if code + "(" in text)

    result = CliRunner().invoke(main, ["run", "-n", "2", script])
    assert result.exit_code == 1, result.output
    assert result.output.splitlines() == [
        f"checker: non-linear on partial at {script}:{line('F.gelu')} in aten.gelu.default: {{tp:P}}  [ranks 0, 1]",
        f"checker: non-linear on partial at {script}:{line('torch.exp')} in aten.exp.default: {{tp:P}}  [ranks 1]",
    ]


@pytest.mark.slow
def test_a_rank_that_fails_otherwise_exits_2_with_its_traceback(tmp_path):
    result = CliRunner().invoke(main, ["run", "-n", "2", _script(tmp_path, "fails")])
    assert result.exit_code == 2
    assert result.stderr.startswith("rank 1 failed with exit code 1\n  Traceback")
    assert "ValueError: rank one is broken" in result.stderr and "rank 0" not in result.stderr


@pytest.mark.slow
def test_the_rank_that_failed_first_is_shown_first_with_its_own_traceback(tmp_path):
    result = CliRunner().invoke(main, ["run", "-n", "2", _script(tmp_path, "peer_fails")])
    assert result.exit_code == 2
    assert result.stderr.startswith("rank 1 failed with exit code 1\n  Traceback")
    first, _, second = result.stderr.partition("rank 0 failed")
    assert "ValueError: rank one broke first" in first and second  # rank 0's Gloo error after it


@pytest.mark.slow
def test_a_hung_rank_is_killed_with_everything_it_started(tmp_path, monkeypatch):
    monkeypatch.setenv("PID_DIR", str(tmp_path))
    script = _script(tmp_path, "hangs")
    result = CliRunner().invoke(main, ["run", "-n", "2", "--timeout", "8", script])
    assert result.exit_code == 2
    assert "rank 0 hung: killed after 8 s" in result.stderr
    assert "rank 1 hung: killed after 8 s" in result.stderr
    pids = [int(p) for f in tmp_path.iterdir() if f.suffix == "" for p in f.read_text().split()]
    assert len(pids) == 4 and wait_gone(pids) == []


@pytest.mark.slow
def test_ctrl_c_leaves_no_process_behind(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = {**os.environ, "PID_DIR": str(pid_dir),
           "PYTHONPATH": os.path.dirname(os.path.dirname(shardcheck.__file__))}
    launcher = subprocess.Popen([sys.executable, "-m", "shardcheck", "run", "-n", "2",
                                 _script(tmp_path, "hangs")], env=env, preexec_fn=interruptible,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = _pids(pid_dir, 2)
    assert len(pids) == 4 and all(alive(p) for p in pids)
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=120) != 0
    assert wait_gone(pids) == []


@pytest.mark.parametrize(("args", "message"), [
    (["run", "missing.py"], "Error: no such script: missing.py"),
    (["run", "-n", "0", __file__], "Error: --nproc and --timeout must be positive"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and result.stderr.strip() == message
