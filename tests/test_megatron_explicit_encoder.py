"""Three megatron-core modules that ignore the model's explicit ``pg_collection`` and reach a
``parallel_state`` global group: T5's cross attention and LLaVA's sequence-parallel scatter (the
global tp group, under sequence parallelism) and the MTP loss log (the global dp_cp group), each
found with numbers, and gone in a copy of megatron-core with the fix."""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

core = pytest.importorskip("megatron.core")

from megatron_release import RELEASE  # noqa: E402

from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD, pools  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.megatron.scenarios import COMPONENTS  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

# Before 0.19 the loss itself reaches the global tp group (LanguageModule's cross-entropy, a
# finding of its own: tests/test_audit_known.py) and diverges first, hiding these.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    RELEASE is not None and RELEASE.release[:2] < (0, 19),
    reason="before megatron-core 0.19 the loss on the global tp group diverges first")]
for module in PRELOAD:
    __import__(module)


@dataclass(frozen=True)
class Bug:
    """Where the audit finds it (the file and function its fix changes), the layout it needs
    and one that agrees with one rank, the fix: (file under megatron/core, pattern,
    replacement) edits, and whether the audit's corrected control agrees with one rank (None:
    the finding has none, the checker's rule broke first)."""

    location: str
    function: str
    layout: Layout
    control: Layout
    fix: tuple[tuple[str, re.Pattern, str], ...]
    corrected: bool | None = None


EXPLICIT_SP = Layout.parse("tp2-dp2-sp@dp-tp")
EXPLICIT = Layout.parse("tp2-dp2@dp-tp")
BUGS = {
    # CrossAttention builds linear_q and linear_kv without tp_group=self.pg_collection.tp
    "t5": Bug("megatron/core/transformer/attention.py", "CrossAttention.__init__", EXPLICIT_SP, EXPLICIT, ((
        "transformer/attention.py",
        re.compile(r'(name=\(name \+ "\.linear_(?:q|kv)"\) if name is not None else None,\n)'),
        r"\1            tp_group=self.pg_collection.tp,\n"),), corrected=True),
    # LLaVA's sequence-parallel scatter of the combined embeddings names no group
    "multimodal": Bug("megatron/core/models/multimodal/llava_model.py", "LLaVAModel._process_embedding_token_parallel",
                      EXPLICIT_SP, EXPLICIT, ((
        "models/multimodal/llava_model.py",
        re.compile(r"scatter_to_sequence_parallel_region\(\s*combined_embeddings\s*\)"),
        "scatter_to_sequence_parallel_region(combined_embeddings, group=self.pg_collection.tp)"),),
                      corrected=True),
    # process_mtp_loss logs the MTP losses and acceptance counts averaged over parallel_state's
    # dp_cp group: the fix passes the model's group through (GPTModel's pg_collection.dp_cp).
    # Without cp: under cp the MTP loss's own CP bug (docs/megatron.md) diverges as well
    "mtp": Bug("megatron/core/transformer/multi_token_prediction.py", "process_mtp_loss", EXPLICIT,
               Layout.parse("tp2-dp2"), (
        ("transformer/multi_token_prediction.py", re.compile(r"(def process_mtp_loss\((?:.|\n)*?)(\) -> Tensor:)"),
         r"\1    dp_cp_group: Optional[torch.distributed.ProcessGroup] = None,\n\2"),
        ("transformer/multi_token_prediction.py",
         re.compile(r"avg_group=parallel_state\.get_data_parallel_group\(with_context_parallel=True\)"),
         "avg_group=dp_cp_group if dp_cp_group is not None else "
         "parallel_state.get_data_parallel_group(with_context_parallel=True)"),
        ("models/gpt/gpt_model.py", re.compile(r"(hidden_states = process_mtp_loss\(\n)(\s+)"),
         r"\1\2dp_cp_group=self.pg_collection.dp_cp,\n\2")), corrected=True),
}


@pytest.fixture(scope="module")
def warm():
    with pools() as shared:
        yield shared


@pytest.mark.parametrize("component", sorted(BUGS))
def test_the_module_on_a_global_group_is_found_under_explicit_groups(warm, component):
    """Found at the line that chose the group (the constructor that built the layer without
    it, the call that passed none: where the fix goes), the title naming that function and the
    generic layer where the collective ran, with the corrected control (parallel_state's
    globals, their aliases included, pointed at the explicit groups)."""
    bug = BUGS[component]
    result = audit([Case(component, (), bug.layout), Case(component, (), bug.control)], run_pools=warm)
    assert not result.errors and len(result.outcomes) == 2
    assert [(f.kind, f.location.rsplit(":", 1)[0], f.trigger["layout"],
             (f.control or {}).get("equal_to_reference")) for f in result.findings] == [
        ("type+numeric", bug.location, str(bug.layout), bug.corrected)]
    title = result.findings[0].title
    assert title.startswith("all_") and f" {bug.function}" in title and "loss differs" not in title, title


@pytest.fixture(scope="module")
def fixed_tree(tmp_path_factory):
    """A copy of the installed megatron/core with every fix."""
    tree = tmp_path_factory.mktemp("fixed")
    shutil.copytree(Path(core.__file__).parent, tree / "megatron" / "core",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for relative, pattern, fix in (edit for bug in BUGS.values() for edit in bug.fix):
        path = tree / "megatron" / "core" / relative
        text, count = pattern.subn(fix, path.read_text())
        assert count, f"{relative}: the buggy line is written differently in this release"
        path.write_text(text)
    return tree


def test_megatron_with_the_fixes_agrees_with_one_rank_under_the_same_layout(fixed_tree, tmp_path):
    only = [arg for c in sorted(BUGS) for arg in ("--only", c)]
    layouts = sorted({str(bug.layout) for bug in BUGS.values()})
    cases = [(c, layout) for c in BUGS for layout in layouts  # the defaults under each layout
             if COMPONENTS[c].refuses(Layout.parse(layout)) is None]
    done = subprocess.run(  # --budget: the plan's first cases are the components' defaults
        [sys.executable, "-m", "shardcheck", "audit", "--megatron", str(fixed_tree), *only,
         "--layouts", ",".join(layouts), "--budget", str(len(cases)), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "findings.json").read_text())
    assert data["findings"] == []
    assert sum(row["cases"] for row in data["coverage"].values()) == len(cases)
