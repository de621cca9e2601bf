"""Ranks forked from a warm interpreter behave as fresh ``python -m`` / ``python SCRIPT`` ranks."""

import json
import os
import sys
import textwrap

import pytest

from shardcheck.fuzz.repro import BROKEN, REPRODUCES, run_repro
from shardcheck.parity.forkserver import (
    WARM_SERVERS,
    ForkServer,
    ServerFailed,
    close_servers,
    server_for,
)
from shardcheck.parity.launch import run_script

SHOW_RANK = """
import json, os, sys
imported_before = "{fresh}" in sys.modules
preloaded = "{heavy}" in sys.modules
import {heavy}, {fresh}
print(json.dumps({{"argv": sys.argv[1:], "path0": sys.path[0], "cwd": os.getcwd(), "rank": os.environ["RANK"],
                  "main": __name__, "preloaded": preloaded, "fresh": imported_before}}))
"""


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """A folder on PYTHONPATH with a heavy module to preload and a rank module that reports itself."""
    (tmp_path / "heavy_stand_in.py").write_text("LOADED = True\n")
    (tmp_path / "fresh_only.py").write_text("")
    (tmp_path / "show_rank.py").write_text(SHOW_RANK.format(heavy="heavy_stand_in", fresh="fresh_only"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    close_servers()


def _reports(run):
    return [json.loads(rank.stderr.strip().splitlines()[-1]) for rank in run.ranks]


def test_forked_ranks_see_what_a_fresh_python_m_rank_sees(modules):
    forked = run_script("-m", ["show_rank", "--flag", "x"], 2, 60, log_stdout=True, preload=("heavy_stand_in",))
    fresh = run_script("-m", ["show_rank", "--flag", "x"], 2, 60, log_stdout=True)
    assert [r.returncode for r in forked.ranks] == [0, 0] == [r.returncode for r in fresh.ranks]
    got, want = _reports(forked), _reports(fresh)
    assert [r["rank"] for r in got] == ["0", "1"]
    assert [{**r, "preloaded": None} for r in got] == [{**r, "preloaded": None} for r in want]
    assert got[0]["argv"] == ["--flag", "x"] and got[0]["main"] == "__main__" and got[0]["cwd"] == str(modules)
    assert got[0]["preloaded"] and not want[0]["preloaded"]  # the server imported it, the fresh one did not
    assert not got[1]["fresh"]  # what rank 0 imported is not in rank 1: each is a fork of the server


@pytest.mark.parametrize(("body", "code", "text"), [
    ("import sys; sys.exit(3)", 3, None),
    ("import sys; sys.exit('stopped: bad flag')", 1, "stopped: bad flag"),
    ("raise ValueError('broken rank')", 1, "ValueError: broken rank"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15, None),
])
def test_a_forked_rank_exits_as_the_interpreter_would(modules, body, code, text):
    (modules / "ending.py").write_text(body + "\n")
    run = run_script("-m", ["ending"], 1, 60, log_stdout=True, preload=("heavy_stand_in",))
    assert run.ranks[0].returncode == code
    if text:
        assert text in run.ranks[0].stderr


def test_a_hung_forked_rank_is_killed_at_the_timeout(modules):
    (modules / "hangs.py").write_text("import time\ntime.sleep(600)\n")
    run = run_script("-m", ["hangs"], 2, 2, log_stdout=True, preload=("heavy_stand_in",))
    assert [r.returncode for r in run.ranks] == [None, None] and run.exit_code == 2


def test_a_server_that_cannot_import_its_modules_is_one_line_and_the_ranks_run_fresh(modules):
    with pytest.raises(ServerFailed, match=r"^cannot import no_such_module: ModuleNotFoundError"):
        ForkServer(("no_such_module",), dict(os.environ))
    run = run_script("-m", ["show_rank"], 1, 60, log_stdout=True, preload=("no_such_module",))
    assert run.ranks[0].returncode == 0 and not _reports(run)[0]["preloaded"]


def test_one_server_per_interpreter_environment(modules):
    env = dict(os.environ)
    assert server_for(("heavy_stand_in",), env) is server_for(("heavy_stand_in",), {**env, "RANK": "3"})
    assert server_for(("heavy_stand_in",), env) is not server_for(("heavy_stand_in",), {**env, "PYTHONWARNINGS": "ignore"})


def test_a_new_server_stops_the_least_recently_used_idle_ones_beyond_the_warm_limit(modules, tmp_path):
    envs = [{**os.environ, "PYTHONWARNINGS": f"ignore::UserWarning:m{i}"} for i in range(WARM_SERVERS + 1)]
    (modules / "hangs.py").write_text("import time\ntime.sleep(600)\n")
    servers = [server_for(("heavy_stand_in",), env) for env in envs[:WARM_SERVERS]]
    servers[0].start(["-m", "hangs"], envs[0], tmp_path / "o", tmp_path / "e")  # busy: kept, though oldest
    assert server_for(("heavy_stand_in",), envs[1]) is servers[1]  # used again: now the most recent
    newest = server_for(("heavy_stand_in",), envs[-1])  # one more than the limit: one must go
    stopped = servers[2] if WARM_SERVERS > 2 else servers[1]  # the least recently used idle one
    assert stopped._proc.wait(timeout=10) == 0
    assert all(s._proc.poll() is None for s in [*servers, newest] if s is not stopped)
    assert servers[0].idle is False
    assert server_for(("heavy_stand_in",), envs[servers.index(stopped)]) is not stopped  # started anew


def test_closing_the_server_kills_its_running_ranks(modules, tmp_path):
    (modules / "hangs.py").write_text("import time\ntime.sleep(600)\n")
    server = ForkServer(("heavy_stand_in",), dict(os.environ))
    rank = server.start(["-m", "hangs"], dict(os.environ), tmp_path / "o", tmp_path / "e")
    assert rank.poll() is None
    server.close()
    with pytest.raises(ProcessLookupError):
        os.kill(rank.pid, 0)


SCRIPT = """
import os, sys
sys.path.insert(0, os.path.dirname(__file__))  # as a script's own folder is first
import heavy_stand_in
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}")
print("diagnostics", file=sys.stderr)
if os.environ["RANK"] == "0":
    print("REPRODUCED abc")
sys.exit(0 if "--fixed" not in sys.argv else 1)
"""


def test_a_preloaded_repro_run_reads_the_script_as_a_fresh_one(modules):
    script = modules / "repro.py"
    script.write_text(SCRIPT)
    fresh = run_repro(script, 2, launcher="direct", timeout=60)
    forked = run_repro(script, 2, launcher="direct", timeout=60, preload=("heavy_stand_in",))
    assert fresh == forked and forked.status == REPRODUCES
    assert forked.output.index("rank 1 of 2") < forked.output.index("diagnostics")  # stdout, then stderr
    fixed = run_repro(script, 2, launcher="direct", timeout=60, args=("--fixed",), preload=("heavy_stand_in",))
    assert fixed.status == BROKEN and fixed.returncode == 1  # exits 1 without a FIXED line


def test_a_hung_preloaded_repro_run_times_out(modules):
    script = modules / "hangs.py"
    script.write_text(textwrap.dedent("""
        import time
        time.sleep(600)
    """))
    result = run_repro(script, 2, launcher="direct", timeout=2, preload=("heavy_stand_in",))
    assert (result.status, result.output) == (BROKEN, "timed out after 2 s")


def test_the_server_imports_nothing_of_shardcheck(modules):
    (modules / "has_shardcheck.py").write_text(
        "import sys\nsys.exit(1 if any(m.startswith('shardcheck') for m in sys.modules) else 0)\n")
    run = run_script("-m", ["has_shardcheck"], 1, 60, log_stdout=True, preload=("heavy_stand_in",))
    assert run.ranks[0].returncode == 0, run.ranks[0].stderr
    assert sys.modules["shardcheck"]  # while this process has it
