"""T5 and LLaVA under explicit process groups: two megatron-core modules that ignore the model's
``pg_collection`` and reach parallel_state's global tp group under sequence parallelism, each
found with numbers, and gone in a copy of megatron-core with the one-line fix."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

core = pytest.importorskip("megatron.core")

from megatron_release import RELEASE  # noqa: E402

from shardcheck.megatron.audit.run import PRELOAD, audit, pools  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

# Before 0.19 the loss itself reaches the global tp group (LanguageModule's cross-entropy, a
# finding of its own: tests/test_audit_known.py) and diverges first, hiding these two.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    RELEASE is not None and RELEASE.release[:2] < (0, 19),
    reason="before megatron-core 0.19 the loss on the global tp group diverges first")]
for module in PRELOAD:
    __import__(module)

EXPLICIT_SP = Layout.parse("tp2-dp2-sp@dp-tp")
EXPLICIT = Layout.parse("tp2-dp2@dp-tp")
# component -> (where parity diverges first, the file the fix goes in, the fix)
BUGS = {
    # CrossAttention builds linear_q and linear_kv without tp_group=self.pg_collection.tp
    "t5": ("megatron/core/tensor_parallel/layers.py", "transformer/attention.py",
           (re.compile(r'(name=\(name \+ "\.linear_(?:q|kv)"\) if name is not None else None,\n)'),
            r"\1            tp_group=self.pg_collection.tp,\n")),
    # LLaVA's sequence-parallel scatter of the combined embeddings names no group
    "multimodal": ("megatron/core/distributed/data_parallel_base.py", "models/multimodal/llava_model.py",
                   (re.compile(r"scatter_to_sequence_parallel_region\(\s*combined_embeddings\s*\)"),
                    "scatter_to_sequence_parallel_region(combined_embeddings, group=self.pg_collection.tp)")),
}


@pytest.fixture(scope="module")
def warm():
    with pools() as shared:
        yield shared


@pytest.mark.parametrize("component", sorted(BUGS))
def test_the_module_on_the_global_tp_group_is_found_under_explicit_groups_with_sp(warm, component):
    result = audit([Case(component, (), EXPLICIT_SP), Case(component, (), EXPLICIT)], run_pools=warm)
    assert not result.errors and len(result.outcomes) == 2
    assert [(f.kind, f.location.rsplit(":", 1)[0], f.trigger["layout"]) for f in result.findings] == [
        ("type+numeric", BUGS[component][0], str(EXPLICIT_SP))]


@pytest.fixture(scope="module")
def fixed_tree(tmp_path_factory):
    """A copy of the installed megatron/core with both one-line fixes."""
    tree = tmp_path_factory.mktemp("fixed")
    shutil.copytree(Path(core.__file__).parent, tree / "megatron" / "core",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for _, relative, (pattern, fix) in BUGS.values():
        path = tree / "megatron" / "core" / relative
        text, count = pattern.subn(fix, path.read_text())
        assert count, f"{relative}: the buggy line is written differently in this release"
        path.write_text(text)
    return tree


def test_megatron_with_the_fixes_agrees_with_one_rank_under_the_same_layout(fixed_tree, tmp_path):
    only = [arg for c in sorted(BUGS) for arg in ("--only", c)]
    done = subprocess.run(  # --budget: the plan's first cases are the components' defaults
        [sys.executable, "-m", "shardcheck", "audit", "--megatron", str(fixed_tree), *only,
         "--layouts", str(EXPLICIT_SP), "--budget", str(len(BUGS)), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "findings.json").read_text())
    assert data["findings"] == []
    assert sum(row["cases"] for row in data["coverage"].values()) == len(BUGS)
