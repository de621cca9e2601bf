"""Audit findings' torchrun scripts: generated per component, reproduce the bug, exit 1 once fixed.

The cp loss script runs under torchrun, as a user runs it; the others' ranks are forked from a
warm interpreter that imported torch and megatron-core (``preload``), which a script's own
imports then find loaded."""

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

pytest.importorskip("megatron.core")

from megatron_release import RELEASE, fixed_in  # noqa: E402
from packaging.version import Version  # noqa: E402
from planted.megatron_site import (  # noqa: E402
    EXPERTS_REDUCED_OVER_DP,
    GDN_OUT_NORM_FIX,
    LLAVA_SP_SLICE,
    MAMBA_CP_ORDER_BUG,
    ROUTER_PER_TOKEN_AUX_LOSS_FIX,
    SOFTMAX_OFFSET_MARKED_FIX,
    T5_CROSS_NORM_NOT_SUMMED,
    TIED_EMBEDDINGS_NOT_SUMMED,
    TP_WEIGHTS_MARKED_WITHOUT_INIT_FIX,
    planted_env,
)  # noqa: E402

from shardcheck.cli import main  # noqa: E402
from shardcheck.fuzz.findings import AUDIT, Finding, FindingStore  # noqa: E402
from shardcheck.fuzz.repro import FIXED, REPRODUCES, SUPPORT_HEADER, ReproError, run_repro  # noqa: E402
from shardcheck.megatron.audit import report as audit_report  # noqa: E402
from shardcheck.megatron.audit.findings import ONE_RANK_CRASH  # noqa: E402
from shardcheck.megatron.audit.report import GLOBAL_GROUP_CONTRACT  # noqa: E402
from shardcheck.megatron.checks.contracts import BY_NAME  # noqa: E402
from shardcheck.megatron.cpu import MEGATRON_PRELOAD  # noqa: E402
from shardcheck.megatron.repro.scripts import save_with_scripts, write_audit_script  # noqa: E402

NO_CONTRACT = "outputs match the one-rank run"


@dataclass(frozen=True)
class Known:
    """A confirmed finding of the default audit in megatron-core 0.16.1: its trigger, contract,
    kind, the checker line the audit recorded, and for a finding whose contract has no fix, its
    fixed control: a fix planted in megatron-core (see tests/planted/megatron_site.py)."""

    component: str
    options: dict
    layout: str
    contract: str | None = None
    kind: str = "numeric-only"
    checker: str | None = None
    planted_fix: str | None = None

    def finding(self):
        return _finding(self.component, self.options, self.layout, self.contract, self.kind, self.checker)


# a script stays readable: the finding's own code, then shared helpers (the stand-ins 0.16
# and 0.19 need, the batch's padding and attention masks), within this many lines
SCRIPT_LINES = 380


def _at(line_016: str, line_019: str) -> str:
    """A checker line's place in this release (megatron-core 0.19 moved the code)."""
    return line_019 if RELEASE is not None and RELEASE >= Version("0.19") else line_016


KNOWN = {
    "label smoothing": Known("output_loss", {"label_smoothing": 0.1}, "tp2", "vocab_parallel_cross_entropy",
                             "type+numeric", "checker: mean over shard at megatron/core/tensor_parallel/"
                             f"cross_entropy.py:{_at('182', '176')} in aten.sub.Tensor: {{tp:R}}, {{tp:P(avg)}}"),
    "cp loss": Known("gpt", {"loss_mask": True}, "cp2", "forward_step_calc_loss", "type+numeric",
                     "checker: non-linear on partial at megatron/core/pipeline_parallel/schedules.py:"
                     f"{_at('262', '334')} in aten.clamp.default: {{cp:P}}, 1"),
    "router count": Known("moe_router", {"padding": True}, "tp2-sp", "get_tokens_per_expert_and_token_count",
                          "type+numeric", "checker: contract at megatron/core/transformer/moe/router.py:"
                          f"{_at('288', '420')} in contract: {{tp:R}}"),
    "router per-token aux loss": Known("moe_router", {"calculate_per_token_loss": True}, "tp2-sp",
                                       planted_fix=ROUTER_PER_TOKEN_AUX_LOSS_FIX),
    "grad norm without tp metadata": Known("gpt", {"perform_initialization": False}, "tp2", "get_grad_norm_fp32",
                                           "type+numeric", "checker: shard counted as replica at megatron/core/optimizer/"
                                           "optimizer.py:156 in param_is_not_tensor_parallel_duplicate: {tp:S(0)}",
                                           TP_WEIGHTS_MARKED_WITHOUT_INIT_FIX),
    "global tp group": Known("gpt", {}, "tp2-cp2-sp@cp-tp", GLOBAL_GROUP_CONTRACT, "type+numeric",
                             "checker: megatron/core/models/common/language_module/language_module.py:167: "
                             "all_reduce on parallel_state's global tp group [0, 1], but the model's "
                             "pg_collection.tp is [0, 2]; the group chosen in LanguageModule."
                             "compute_language_model_loss, the collective issued at "
                             "megatron/core/tensor_parallel/cross_entropy.py:130"),
    "gdn out_norm grad": Known("gdn", {}, "tp2", planted_fix=GDN_OUT_NORM_FIX),
    "learnable softmax offset": Known("gpt", {"softmax_type": "learnable"}, "tp2", None, "type+numeric",
                                      "checker: shard counted as replica at megatron/core/optimizer/optimizer.py:"
                                      f"{_at('156', '270')} in param_is_not_tensor_parallel_duplicate: {{tp:S(0)}}",
                                      SOFTMAX_OFFSET_MARKED_FIX),
}
FIXED_IN_019 = {"router per-token aux loss", "grad norm without tp metadata", "global tp group"}


def _finding(component, options, layout, contract=None, kind="numeric-only", checker=None):
    notation = BY_NAME[contract].notation() if contract in BY_NAME else contract or NO_CONTRACT
    return Finding(title=f"{component} differs under {layout}", target=component, location="megatron/core/x.py:1",
                   contract=notation, layout=layout, config=options, observed=None, reference=None,
                   kind=kind, checker=checker, origin=AUDIT)


def _has_fix(contract):
    return contract == GLOBAL_GROUP_CONTRACT or (contract in BY_NAME and BY_NAME[contract].fix is not None)


@pytest.fixture(scope="module")
def no_shardcheck(tmp_path_factory):
    """An environment whose scripts cannot import shardcheck (a package that refuses to import,
    first on the path) but keep the caller's other paths (the megatron-core 0.16.1 overlay)."""
    hidden = tmp_path_factory.mktemp("hidden") / "shardcheck"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('shardcheck is not installed here')\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(hidden.parent), os.environ.get("PYTHONPATH")]))}


def _values(output: str, label: str) -> list[float]:
    line = next(line for line in output.splitlines() if line.startswith(f"{label}:"))
    return [float(x) for x in line.split(":", 1)[1].replace("...", "").split(",") if x.strip()]


def _farthest(output: str) -> tuple[list[float], list[float]]:
    """Observed and reference where they differ most: the entry the script names, when it
    names one (a long value), else the values it shows."""
    named = re.search(r"^differs most at entry \d+: observed (\S+), reference (\S+)$", output, re.M)
    if named:
        return [float(named[1])], [float(named[2])]
    return _values(output, "observed"), _values(output, "reference")


@pytest.mark.slow
@pytest.mark.release_specific
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=fixed_in("0.19", name) if name in FIXED_IN_019 else ()) for name in KNOWN])
def test_known_finding_script_reproduces_then_exits_1_with_the_fix(name, tmp_path, no_shardcheck):
    known = KNOWN[name]
    finding = known.finding()
    path = write_audit_script(finding, tmp_path / f"{finding.id}.py")
    script = path.read_text()
    # shardcheck only in the guarded import for the checker: line
    assert re.findall(r"^\s*(?:import|from)\s+shardcheck.*", script, re.M) == [
        "            from shardcheck.megatron.repro.check import checked_run"]
    assert "except ImportError:" in script
    own, support = script.split(SUPPORT_HEADER)  # the finding's code first, the shared helpers after
    # with the stand-ins 0.16 and 0.19 need, and what the gradient norm counts
    assert len(own.splitlines()) <= 150 and len(script.splitlines()) <= SCRIPT_LINES

    launcher = "torchrun" if name == "cp loss" else "direct"
    buggy = run_repro(path, finding.world_size, launcher=launcher, timeout=600, preload=MEGATRON_PRELOAD)
    assert (buggy.status, buggy.returncode) == (REPRODUCES, 0), buggy.output
    assert f"REPRODUCED {finding.id}" in buggy.output
    observed, reference = _farthest(buggy.output)
    assert observed != pytest.approx(reference, rel=1e-4, abs=1e-6)
    reference = _values(buggy.output, "reference")
    checker_lines = [line for line in buggy.output.splitlines() if line.startswith("checker:")]
    assert checker_lines == ([finding.checker] if finding.checker else [])  # the checker raised it again
    if not _has_fix(known.contract):  # no fix control: no corrected line, no --fixed
        assert "corrected:" not in buggy.output and "--fixed" not in script
        assert known.planted_fix, "every known finding has a fixed control"
        # the unchanged script against a megatron-core with the fix planted
        _assert_fixed(path, finding, env=planted_env(tmp_path / "site", known.planted_fix))
        return
    assert _values(buggy.output, "corrected") == pytest.approx(reference, rel=1e-4, abs=1e-6)
    # the fix patched in by the script itself; and the script runs where shardcheck is absent
    fixed = run_repro(path, finding.world_size, launcher="direct", timeout=600, preload=MEGATRON_PRELOAD, args=("--fixed",), env=no_shardcheck)
    assert (fixed.status, fixed.returncode) == (FIXED, 1), fixed.output
    assert "REPRODUCED" not in fixed.output and "checker:" not in fixed.output


@pytest.mark.parametrize(("component", "options", "layout"), [
    ("output_loss", {"parallel_output": False}, "tp2-sp"),
    ("gpt", {"normalization": "RMSNorm", "share_embeddings": True}, "cp2-dp2"),
    ("moe_router", {"moe_router_score_function": "sigmoid"}, "ep2-dp2"),
    ("gdn", {"use_qk_l2norm": False}, "tp2-dp2@dp-tp"),
    ("t5", {"share_embeddings": True, "position_embedding": "rope"}, "tp2-dp2"),
    ("multimodal", {"projection": "affine", "keep_class_token": True}, "dp2"),
    ("mamba", {"use_mamba_mem_eff_path": False, "d_has_hdim": True}, "tp2-cp2-sp"),
])
def test_any_finding_of_a_templated_component_gets_a_script(component, options, layout, tmp_path):
    text = write_audit_script(_finding(component, options, layout), tmp_path / "x.py").read_text()
    compile(text, "x.py", "exec")
    assert f"Trigger: layout {layout}," in text and "def run(sizes, pg):" in text
    assert "corrected()" not in text  # no contract, no fix control
    for name, value in options.items():
        assert f"{name!r}: {value!r}" in text


@pytest.mark.slow
@pytest.mark.parametrize(("component", "options", "layout"), [  # moe, t5, multimodal: their controls below
    ("gpt", {"gated_linear_unit": True}, "tp2-dp2"),  # fused fc1: each section cut over tp
    ("gdn", {}, "tp2-sp"),  # fused in_proj and conv1d; out_norm summed over tp under SP
    ("mamba", {}, "tp2-sp"),  # fused in_proj and conv1d (0.19: conv1d_weight), SSD scan
])
def test_script_of_correct_megatron_code_finds_observed_equal_to_reference(component, options, layout, tmp_path):
    finding = _finding(component, options, layout)
    _assert_fixed(write_audit_script(finding, tmp_path / "x.py"), finding)


def _assert_fixed(path, finding, env=None):
    result = run_repro(path, finding.world_size, launcher="direct", timeout=600, preload=MEGATRON_PRELOAD, env=env)
    assert (result.status, result.returncode) == (FIXED, 1), result.output
    assert _values(result.output, "observed") == pytest.approx(_values(result.output, "reference"), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(("component", "options", "layout", "bug"), [
    # expert gradients averaged over dp; experts by global index (control: the all-to-all dispatcher)
    ("moe", {"moe_token_dispatcher_type": "alltoall"}, "ep2-dp2", EXPERTS_REDUCED_OVER_DP),
    ("gpt", {"share_embeddings": True}, "pp2", TIED_EMBEDDINGS_NOT_SUMMED),  # tied copies not summed; layers by global index
    # the cross-attention norm's gradient not summed over tp (control: cross attention over padded encoder output)
    ("t5", {"encoder_padding": True, "loss_mask": True}, "tp2-sp", T5_CROSS_NORM_NOT_SUMMED),
    # the SP cut of the combined embeddings without its gather (control: LLaVA's SP scatter, class token kept)
    ("multimodal", {"keep_class_token": True, "text_only_sample": True}, "tp2-sp", LLAVA_SP_SLICE),
    ("mamba", {}, "cp2", MAMBA_CP_ORDER_BUG),  # the mixer ignores attention's load-balanced order
])
def test_script_reproduces_a_bug_planted_in_megatron_core_and_passes_without_it(component, options, layout, bug,
                                                                                tmp_path):
    finding = _finding(component, options, layout)
    path = write_audit_script(finding, tmp_path / "x.py")
    own = path.read_text().split(SUPPORT_HEADER)[0]
    assert len(own.splitlines()) <= 150 and len(path.read_text().splitlines()) <= SCRIPT_LINES
    result = run_repro(path, finding.world_size, launcher="direct", timeout=600, preload=MEGATRON_PRELOAD,
                       env=planted_env(tmp_path / "site", bug))
    assert (result.status, result.returncode) == (REPRODUCES, 0), result.output
    assert f"REPRODUCED {finding.id}" in result.output
    _assert_fixed(path, finding)  # the control: the same script on the unchanged megatron-core


@pytest.mark.parametrize(("finding", "message"), [
    (_finding("retro", {}, "tp2"), "no repro template for component 'retro'"),
    (_finding("t5", {}, "pp2"), "T5 under pipeline parallelism puts encoder and decoder on separate stages"),
    (_finding("t5", {}, "cp2"), "cross attention under context parallelism needs Transformer Engine"),
    (_finding("multimodal", {}, "cp2-dp2"), "LLaVA's context-parallel path imports megatron.training"),
    (_finding("multimodal", {}, "ep2-dp2"), "expert parallelism needs a component with experts"),
    (_finding("gdn", {}, "cp2"), "without context parallelism"),
    (_finding("moe", {"moe_token_dispatcher_type": "alltoall"}, "tp2-dp2-ep2-sp"), "Gloo refuses"),
    (_finding("moe_router", {}, "tp2"), "needs sequence parallelism"),
    (_finding("mamba", {}, "tp2-pp2"), "no pipeline stages"),
    (_finding("moe", {"impl": "te"}, "tp2-sp"), "no script for a finding on Transformer Engine yet"),
    (_finding("gpt", {"heterogeneous": True}, "tp2-dp2@dp-tp"), "no script for a heterogeneous GPT yet"),
    (_finding("gpt", {}, "cp2", kind="type-only"), "type-only"),
])
def test_finding_without_a_script_says_why(finding, message, tmp_path):
    with pytest.raises(ReproError, match=re.escape(message)):
        write_audit_script(finding, tmp_path / "x.py")
    assert not (tmp_path / "x.py").exists()


def _audit_finding(component, layout, kind="numeric-only"):
    return Finding.audited(
        {"component": component, "options": {}, "layout": layout},
        [{"value": "loss", "observed": 1.0, "reference": 2.0, "max_abs_error": 1.0, "max_rel_error": 0.5}], None,
        title="t", kind=kind, location=f"megatron/core/{component}.py:1", contract=NO_CONTRACT,
        first_divergence=None, checker=None, reproduce=f"shardcheck audit --only {component} --layouts {layout}")


def test_audit_findings_join_the_store_with_their_scripts_and_repro_reads_them(tmp_path):
    found = [_audit_finding("output_loss", "tp2"), _audit_finding("retro", "tp2"),
             _audit_finding("gpt", "tp2", kind="type-only")]
    # a one-rank crash compares nothing (no effect): its script raises it (the default audit once
    # stopped here with an IndexError)
    crash = Finding.audited({"component": "gpt", "options": {}, "layout": "tp1"}, [], None, title="t",
                            kind=ONE_RANK_CRASH, location="megatron/core/tensor_parallel/cross_entropy.py:190",
                            contract="runs on one rank (RuntimeError)", first_divergence=None, checker=None,
                            reproduce="shardcheck audit --only gpt --layouts tp1")
    save_with_scripts([*found, crash], tmp_path / "out", tmp_path / "store")
    assert crash.repro == str(tmp_path / "out" / "repro" / f"{crash.id}.py")
    scripted, untemplated, typed = found
    assert scripted.repro == str(tmp_path / "out" / "repro" / f"{scripted.id}.py")
    assert untemplated.repro.startswith("no script: no repro template for component 'retro'")
    assert typed.repro is None
    stored = {f.id: f for f in FindingStore(tmp_path / "store").all()}
    assert set(stored) == {f.id for f in [*found, crash]} and {f.origin for f in stored.values()} == {AUDIT}
    assert stored[scripted.id].repro == scripted.repro and stored[scripted.id].config == {}
    assert f"**repro script**: `torchrun --standalone --nproc-per-node=2 {scripted.repro}`" in \
        audit_report.markdown(found, {})

    out = tmp_path / "again.py"
    result = CliRunner().invoke(main, ["repro", scripted.id[:6], "-o", str(out), "--root", str(tmp_path / "store")])
    assert result.exit_code == 0, result.output
    assert out.read_text() == (tmp_path / "out" / "repro" / f"{scripted.id}.py").read_text().replace(
        f"{scripted.id}.py", "again.py")
    result = CliRunner().invoke(main, ["repro", untemplated.id, "--root", str(tmp_path / "store")])
    assert result.exit_code == 2 and "no repro template for component 'retro'" in result.output
    listed = CliRunner().invoke(main, ["findings", "--no-run", "--root", str(tmp_path / "store")])
    assert listed.exit_code == 0 and scripted.id in listed.output and untemplated.id in listed.output


def test_megatron_fuzz_findings_get_their_scripts_from_the_same_templates(tmp_path):
    from shardcheck.fuzz.campaign import resolve_target
    from shardcheck.megatron import fuzz_targets  # noqa: F401  (registers the catalogue)

    finding = _finding("output_loss", {"label_smoothing": 0.1, "seq": 4}, "tp2-sp", "vocab_parallel_cross_entropy")
    finding.origin = "fuzz"
    text = resolve_target("output_loss").write_repro(finding, tmp_path / "f.py").read_text()
    assert "'seq': 4" in text and "vocab_parallel_cross_entropy(" in text and "def corrected():" in text
    from shardcheck.megatron.repro.templates import TEMPLATES
    from shardcheck.megatron.scenarios import COMPONENTS

    assert {c for c in COMPONENTS if resolve_target(c).repro is not None} == set(COMPONENTS) & set(TEMPLATES)


@pytest.mark.parametrize("control,fixed", [
    (None, True),  # no control on record: the contract's fix, as before controls were kept
    ({"fix": "global smoothing", "result": "corrected == reference (max abs error 0 after the fix)",
      "equal_to_reference": True}, True),
    ({"fix": "global smoothing", "result": "still differs: loss (max abs error 0.1 after the fix)",
      "equal_to_reference": False}, False),  # another cause at the same call: no --fixed run
])
def test_a_script_runs_the_fix_only_when_the_audit_saw_it_repair_the_finding(control, fixed, tmp_path):
    for contract in ("vocab_parallel_cross_entropy", GLOBAL_GROUP_CONTRACT):
        finding = _finding("output_loss", {"parallel_output": False}, "tp2", contract)
        finding.control = control
        finding.corrected = control["result"] if control else None
        text = write_audit_script(finding, tmp_path / "x.py").read_text()
        assert ("def corrected():" in text and "FIXED" in text) is fixed, contract


def test_a_scripts_fix_takes_the_arguments_of_the_function_it_replaces():
    """Under ``--fixed`` the script puts its fix in megatron-core before the checker's probes
    wrap what they find there; a probe binds the call's arguments by that function's signature
    (``process_mtp_loss``'s ``config``), so the fix answers with the original's."""
    import inspect
    import sys

    from megatron.core.transformer import multi_token_prediction

    from shardcheck.megatron.repro.templates import _fix

    if not hasattr(multi_token_prediction, "process_mtp_loss"):
        pytest.skip("this megatron-core has no process_mtp_loss (0.19 on)")
    finding = _finding("mtp", {}, "cp2", "process_mtp_loss")
    contract = BY_NAME["process_mtp_loss"]
    snippet, namespace = _fix(finding), {"sys": sys}
    exec(f"{snippet.imports}\n{snippet.code}", namespace)
    assert inspect.signature(namespace[contract.fix.__name__]) == inspect.signature(contract.original())


def test_a_recompute_script_reruns_its_checkpoints_backward_on_the_cpu(tmp_path):
    """A checkpoint's backward reruns forward code outside the script's CPU mode: the decoder's
    distributed-recompute finding (365a83aafe) stopped with 'Torch not compiled with CUDA'."""
    options = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    recompute = write_audit_script(_finding("gpt", options, "tp2"), tmp_path / "recompute.py").read_text()
    plain = write_audit_script(_finding("gpt", {}, "tp2"), tmp_path / "plain.py").read_text()
    assert "_function.backward = _under_cpu_mode(_function.backward)" in recompute
    assert "_under_cpu_mode" not in plain


def test_an_mla_script_installs_shardcheck_te_layer_before_megatron_core_and_cuts_the_fused_weight(
        tmp_path, no_shardcheck):
    """MLA builds on Transformer Engine only, which a script runs on a CPU through shardcheck's TE
    layer, installed before megatron-core is imported; the fused down projection's weight is cut
    section by section (torchrun runs: docs/audit.md, "Multi-latent attention")."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cases = {"p.py": ({}, "tp2")}
    if hasattr(MLATransformerConfig, "mla_down_proj_fusion"):  # megatron-core 0.19 on
        cases["f.py"] = ({"mla_down_proj_fusion": True}, "tp2-sp")
    texts = {name: write_audit_script(_finding("mla", *case), tmp_path / name).read_text() for name, case in cases.items()}
    for text in texts.values():
        compile(text, "x.py", "exec")
        assert text.index("import shardcheck.megatron.cpu.te.install_on_import") < text.index("from megatron")
        assert "'q_lora_rank': 16" in text and len(text.splitlines()) <= SCRIPT_LINES
    assert "SECTIONS = {}" in texts["p.py"]
    if "f.py" in texts:
        assert "SECTIONS = {'linear_qkv_down_proj.weight': [16, 20]}" in texts["f.py"]
    gpt = write_audit_script(_finding("gpt", {}, "tp2"), tmp_path / "g.py").read_text()
    assert "install_on_import" not in gpt  # the local spec's scripts run without shardcheck
    # a verified piece fix (the audit's corrected control) gives the script its corrected run and --fixed
    site = "megatron/core/transformer/multi_latent_attention.py:749"
    for verified in (True, False):
        finding = _finding("mla", {}, "tp2")
        finding.control = {"fix": "all-reduce piece 1", "name": f"reduced gradients of pieces tp:1:{site}",
                           "result": "corrected == reference", "equal_to_reference": verified}
        stored = Finding.from_json(finding.to_json())  # `shardcheck repro` reads the store's record
        for text in (write_audit_script(f, tmp_path / "c.py").read_text() for f in (finding, stored)):
            assert (f"PIECE_FIX = ('tp', (1,), {site!r})" in text and "def corrected():" in text) is verified
        assert len(text.splitlines()) <= SCRIPT_LINES
    # without shardcheck: one line, and exit 2 (neither reproduced nor fixed)
    alone = subprocess.run([sys.executable, str(tmp_path / "p.py")], capture_output=True, text=True, timeout=60,
                           env={**os.environ, **no_shardcheck}, check=False)
    assert alone.returncode == 2 and alone.stderr.strip().splitlines() == [
        "this script runs Transformer Engine on a CPU through shardcheck's TE layer: shardcheck is not installed here"]
