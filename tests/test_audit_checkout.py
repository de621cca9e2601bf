"""`shardcheck audit --megatron PATH`: a source tree audited as such, a planted bug found in it."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

core = pytest.importorskip("megatron.core")

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
MAPPINGS = Path("megatron/core/tensor_parallel/mappings.py")
# Megatron's tp all-reduce over the group its caller gives: planted, over parallel_state's
# global tp group (what the helper gives for None), which the explicit-group layout makes
# another set of ranks than the model's pg_collection.tp.
REDUCE = re.compile(r"torch\.distributed\.all_reduce\((.+), group=group\)")
ON_GLOBAL_GROUP = r"torch.distributed.all_reduce(\1, group=get_tensor_model_parallel_group_if_none(None))"
# The router with its default options only: its options include padding=True, a real bug of
# every release under cp (tests/test_audit_known.py), which is not what these tests plant.
AUDIT = ("--only", "moe_router", "--layouts", "tp2-cp2-sp@cp-tp", "--set", "padding=False")


def _git(tree: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A git checkout holding a copy of the installed megatron/core, committed unmodified."""
    tree = tmp_path_factory.mktemp("Megatron-LM")
    shutil.copytree(Path(core.__file__).parent, tree / "megatron" / "core",
                    ignore=shutil.ignore_patterns("__pycache__"))
    text = (tree / MAPPINGS).read_text()
    if not REDUCE.search(text) or "get_tensor_model_parallel_group_if_none" not in text:
        pytest.skip("this megatron-core's tp all-reduce is written differently")
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", "copy")
    return tree


def _audit(tree: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "shardcheck", "audit", "--megatron", str(tree), "--out",
                           str(out), "--root", str(out / "store"), *args],
                          capture_output=True, text=True, env=env, timeout=600, check=False)


def test_the_unmodified_checkout_gives_no_finding_and_says_what_was_audited(checkout, tmp_path):
    done = _audit(checkout, tmp_path, *AUDIT)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "findings.json").read_text())
    assert list(data)[0] == "audited" and data["findings"] == []
    assert data["summary"]["cases run"] == 1 and data["summary"]["cases failed to run"] == 0
    audited = data["audited"]
    release = core.__version__.split("+")[0]  # 0.19 appends the commit of an enclosing work tree
    assert audited.pop("version").startswith(release)
    assert audited == {"path": str(checkout.resolve()), "tree": True,
                       "git_commit": _git(checkout, "rev-parse", "HEAD"), "git_dirty": False}
    report = (tmp_path / "report.md").read_text()
    assert f"Audited: megatron-core {release}" in report
    assert f" at {checkout.resolve()} (git {audited['git_commit'][:12]}, clean)" in report


def test_a_bug_planted_in_one_line_of_the_checkout_is_found_at_that_line(checkout, tmp_path):
    source = checkout / MAPPINGS
    lines = source.read_text().splitlines(keepends=True)
    number = next(n for n, line in enumerate(lines, 1) if REDUCE.search(line))  # in _reduce
    lines[number - 1] = REDUCE.sub(ON_GLOBAL_GROUP, lines[number - 1])
    source.write_text("".join(lines))
    try:
        done = _audit(checkout, tmp_path, *AUDIT)
    finally:
        _git(checkout, "checkout", "--", str(MAPPINGS))
    assert done.returncode == 1, done.stdout + done.stderr  # it found something (exit status 1)
    data = json.loads((tmp_path / "findings.json").read_text())
    assert data["audited"]["git_dirty"] is True
    [finding] = data["findings"]
    assert finding["location"] == f"{MAPPINGS}:{number}"
    assert finding["kind"] == "type+numeric" and f"{MAPPINGS}:{number}: all_reduce" in finding["checker"]
    script = Path(finding["repro"]).read_text()
    assert f"sys.path.insert(0, {str(checkout.resolve())!r})" in script  # the script runs the checkout


@pytest.mark.parametrize("folder", ["empty", "missing", "megatron-without-core"])
def test_a_folder_that_is_not_a_megatron_tree_gets_one_line_and_exit_2(folder, tmp_path):
    path = tmp_path / folder
    if folder != "missing":
        (path / "megatron" if folder == "megatron-without-core" else path).mkdir(parents=True)
    done = _audit(path, tmp_path / "out", "--budget", "1")
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert str(path) in done.stderr and "Traceback" not in done.stderr


# the experts at an expert tp size other than tp's, where megatron-core gives them their own
# grid (etp x ep x edp): the installed release's defaults there
ETP_AUDIT = ("--only", "moe", "--layouts", "tp2-etp1-sp,tp2-ep2-etp1-sp", "--set", "seed=0")


def test_the_checkout_gives_no_finding_at_the_expert_tp_layouts(checkout, tmp_path):
    if subprocess.run(["git", "-C", str(checkout), "apply", "-R", "--check", str(FIXES / "cd4afffa64.diff")],
                      capture_output=True, check=False).returncode:
        pytest.skip("this megatron-core predates #5916 (cd4afffa64), whose bug tp2-etp1-sp shows")
    done = _audit(checkout, tmp_path, *ETP_AUDIT)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "findings.json").read_text())
    assert data["findings"] == [] and data["summary"]["cases run"] == 2


FIXES = REPO / "tests" / "data" / "megatron-fixes"  # upstream diffs, BSD-3 (README.md there)


# where a replay's finding must be located: in the file and function of the fix's first hunk
# (its first changed line), or in a file and function any of its hunks changes
FIRST_HUNK, ANY_HUNK = "first hunk", "any hunk"

# Real Megatron-LM fixes of silent bugs, each reverted in the checkout (which holds the fix):
# the diff, the audit that reaches it, the outputs that differ first, and where the finding is
# located (FIRST_HUNK or ANY_HUNK)
REVERTED = {
    # the logged z-loss metric recorded without averaging over tp, dp and cp (#3199): MoE's
    # aux-loss weights are swept, the MoE metrics the training loop logs are outputs, and a
    # metric's finding is located at the call that recorded it
    "4abeecce74": (("--only", "moe", "--layouts", "tp2-sp", "--set", "moe_z_loss_coeff=0.1"), ["moe/z_loss"], FIRST_HUNK),
    # the sequence-level aux loss's gradient kept a 1/micro-batch-size factor under the
    # per-token loss (#5798): the one-rank reference takes the whole batch in one micro-batch, and
    # the first gradient that depends on the split names the function whose aux-loss term scaled
    # it (the call that attaches the term, in _apply_seq_aux_loss)
    "e3fe5508c9": (("--only", "moe", "--layouts", "dp2", "--set", "moe_router_load_balancing_type=seq_aux_loss",
                    "--set", "calculate_per_token_loss=True"),
                   ["get_grad_norm_fp32#0.total_norm", "grad/decoder.layers.mlp.router.weight"], FIRST_HUNK),
    # the same at tp2-sp: each micro-batch's gradients are rebuilt from the tp ranks' sequence
    # shards by their types before they are compared with the whole batch's
    "e3fe5508c9@tp2-sp": (("--only", "moe", "--layouts", "tp2-sp", "--set",
                           "moe_router_load_balancing_type=seq_aux_loss", "--set", "calculate_per_token_loss=True"),
                          ["get_grad_norm_fp32#0.total_norm", "grad/decoder.layers.mlp.router.weight"], FIRST_HUNK),
    # the experts' linears took the expert topology (allreduce=False: expert-dp gradient buffers)
    # only with ep > 1, not for an expert tp size other than tp's (#5916): at tp2-etp1-sp the tp
    # ranks hold the same experts, fed other tokens, and their gradients went unreduced over
    # edp; the finding is located where a linear's constructor set allreduce (the fix's first
    # hunk is a docstring of param_and_grad_buffer.py, so any hunk's function)
    "cd4afffa64": (("--only", "moe", "--layouts", "tp2-etp1-sp", "--set", "seed=0"),
                   ["get_grad_norm_fp32#0.total_norm", "grad/decoder.layers.mlp.experts.experts.linear_fc2.weight"],
                   ANY_HUNK),
    # the unfused vocab-parallel cross-entropy reduced over parallel_state's tp group, not the
    # model's (#5128): the explicit-group layout makes them other ranks, and the finding is
    # located at the call in compute_language_model_loss that did not hand it the model's group
    "4a47b160c0": (("--only", "gpt", "--layouts", "tp2-dp2@dp-tp", "--set", "seed=0"),
                   ["get_grad_norm_fp32#0.total_norm"], FIRST_HUNK),
}


def _function_at(path: Path, line: int) -> str | None:
    """The innermost function of ``path`` whose lines hold ``line``."""
    found = None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.lineno <= line <= node.end_lineno:
            if found is None or node.lineno > found.lineno:
                found = node
    return found.name if found is not None else None


def _changed_lines(diff: str) -> list[tuple[str, int]]:
    """Each hunk's first changed line, in the parent's file (the ``-`` side), in the diff's order."""
    found, path = [], None
    for block in re.split(r"^(?=\+\+\+ b/|@@ -)", diff, flags=re.MULTILINE):
        if block.startswith("+++ b/"):
            path = block.split()[1].removeprefix("b/")
        elif block.startswith("@@ -"):
            start = int(re.match(r"@@ -(\d+)", block).group(1))
            body = block.split("\n")[1:]
            context = next(n for n, text in enumerate(body) if text.startswith(("-", "+")))
            found.append((path, start + context))
    return found


def test_each_hunk_of_a_fix_is_read_at_its_first_changed_line():
    text = (FIXES / "cd4afffa64.diff").read_text()
    lines = _changed_lines(text)
    assert len(lines) == text.count("\n@@ -")
    assert lines[0] == ("megatron/core/distributed/param_and_grad_buffer.py", 890)
    assert ("megatron/core/tensor_parallel/layers.py", 1007) in lines  # the parent's setattr


@pytest.mark.parametrize("fix", sorted(REVERTED))
def test_a_real_megatron_fix_reverted_in_the_checkout_is_found(fix, checkout, tmp_path):
    """The parent of a real fix gives a finding, located where the table says: in the file and
    function of the fix's first hunk, or of any of its hunks (their changed lines, in the
    parent's files)."""
    diff = FIXES / f"{fix.split('@')[0]}.diff"
    if subprocess.run(["git", "-C", str(checkout), "apply", "-R", "--check", str(diff)],
                      capture_output=True, check=False).returncode:
        pytest.skip(f"this megatron-core's code differs where {fix} changed it")
    args, differ, where = REVERTED[fix]
    changed = _changed_lines(diff.read_text())
    _git(checkout, "apply", "-R", str(diff))
    try:
        functions = [(path, _function_at(checkout / path, line)) for path, line in changed]
        done = _audit(checkout, tmp_path, *args)
        [finding] = json.loads((tmp_path / "findings.json").read_text())["findings"]
        path, line = finding["location"].rsplit(":", 1)
        located = (path, _function_at(checkout / path, int(line)))
    finally:
        _git(checkout, "checkout", "--", *sorted({path for path, _ in changed}))
    assert done.returncode == 1, done.stdout + done.stderr
    values = [effect["value"] for effect in finding["effect"]]
    assert values[:len(differ)] == differ, values
    # a metric recorded wrong changes no loss or gradient: its effect is the metric alone
    assert not differ[0].startswith(("moe/", "mtp/")) or values == differ, values
    expected = functions[:1] if where == FIRST_HUNK else functions
    assert located in expected, (finding["location"], finding["first_op"], expected)
