"""The GPT with multi-token prediction (``mtp``) on real megatron-core, against its one-rank run.

Correct where Megatron gets MTP right (tp, tp with sp, dp, pp with rotary positions), no finding
of any kind there; two bugs of megatron-core found, each at its own function with a corrected
control equal to the one-rank run (the CP token count of the MTP loss, on releases that have
``process_mtp_loss``; the position-embedding table of the MTP stage under pp); and a reduction
planted out of the MTP path found at the planted function. The component's repro scripts
agree with one rank on correct code, and reproduce the planted bug and megatron-core's.
"""

import importlib
import inspect

import pytest

pytest.importorskip("megatron.core")

from audit_outcomes import worst_relative  # noqa: E402
from planted.megatron_site import MTP_WORD_EMBEDDINGS_NOT_SUMMED, planted_env  # noqa: E402

from shardcheck.fuzz.findings import AUDIT, Finding  # noqa: E402
from shardcheck.fuzz.repro import FIXED, REPRODUCES, run_repro  # noqa: E402
from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD, pools  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.megatron.checks import contracts  # noqa: E402
from shardcheck.megatron.cpu import MEGATRON_PRELOAD  # noqa: E402
from shardcheck.megatron.repro.scripts import write_audit_script  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow
for module in PRELOAD:
    __import__(module)

ROPE = (("position_embedding", "rope"),)  # the MTP GPT's default (megatron.training's demand)
LEARNED = (("position_embedding", "learned_absolute"),)
CORRECT = [(Layout(tp=2), ()), (Layout(tp=2, sp=True), ()), (Layout(dp=2), ()), (Layout(pp=2), ROPE)]
HAS_PROCESS_MTP_LOSS = contracts.BY_NAME["process_mtp_loss"].present()


@pytest.fixture(scope="module")
def warm():
    with pools() as shared:
        yield shared


def test_mtp_on_correct_layouts_agrees_with_one_rank_and_gives_no_finding_of_any_kind(warm):
    """Each layout's train step is as close to one rank as sums in another order allow (the MTP
    layers' gradients, every gradient and parameter, the logged MTP losses), and no finding."""
    result = audit([Case("mtp", options, layout) for layout, options in CORRECT], run_pools=warm)
    assert not result.errors, [o.error for o in result.errors]
    assert len(result.outcomes) == len(CORRECT)
    assert result.findings == []  # type-only included: the rolled CP chunks, the logged rates
    for outcome in result.outcomes:
        reference = warm.references[("mtp", outcome.case.options, 0)].outputs
        assert {"mtp/mtp_1 loss", "mtp/mtp_2 loss"} <= set(reference)
        assert any(k.startswith("grad/mtp.layers.1.") for k in reference)  # two MTP layers trained
        for prefix, tolerance in (("grad/mtp.", 1e-5), ("grad/", 1e-5), ("param/", 1e-4), ("mtp/", 1e-6)):
            assert worst_relative(outcome, reference, prefix) < tolerance, (outcome.case.layout, prefix)


@pytest.fixture(scope="module")
def megatron_bugs(warm):
    return audit([Case("mtp", (), Layout(cp=2)), Case("mtp", LEARNED, Layout(pp=2))], run_pools=warm)


@pytest.mark.skipif(not HAS_PROCESS_MTP_LOSS, reason="process_mtp_loss came with megatron-core 0.17")
def test_mtp_loss_over_each_cp_ranks_own_token_count_is_found_with_a_corrected_control(megatron_bugs):
    [finding] = [f for f in megatron_bugs.findings if f.trigger["layout"] == "cp2"]
    assert finding.location == contracts.BY_NAME["process_mtp_loss"].location()
    assert finding.location.startswith("megatron/core/transformer/multi_token_prediction.py:")
    assert finding.contract.startswith("process_mtp_loss: ensures mtp_losses")
    assert finding.effect[0]["max_abs_error"] > 1e-5
    assert finding.control["equal_to_reference"], finding.control
    assert (finding.checker or "").startswith("checker: non-linear on partial at "
                                              "megatron/core/transformer/multi_token_prediction.py:")


def test_the_mtp_stages_position_embeddings_left_out_of_the_pp_sync_is_its_own_finding(megatron_bugs):
    where = contracts.BY_NAME["_allreduce_position_embedding_grads"].location()
    [finding] = [f for f in megatron_bugs.findings if f.location == where]
    layouts = {case["layout"] for case in finding.cases}
    assert "finalize_model_grads.py:" in where and "pp2" in layouts
    assert len({f.id for f in megatron_bugs.findings}) == len(megatron_bugs.findings)
    if not HAS_PROCESS_MTP_LOSS:  # 0.16.1: no contract locates the CP bug, which joins this one
        assert len(megatron_bugs.findings) == 1 and "cp2" in layouts
        return
    assert len(megatron_bugs.findings) == 2 and layouts == {"pp2"} and finding.seen_in == ["layouts: pp2"]
    assert any("position_embeddings" in e["value"] for e in finding.effect)
    assert finding.control["equal_to_reference"], finding.control
    # a training job never builds it: megatron.training refuses MTP with learned absolute positions
    assert finding.training_args.startswith("megatron.training refuses it: AssertionError: Multi-Token "
                                            "Prediction (MTP) is not supported with learned_absolute"), finding.training_args
    # the cp2 one, under the default rotary positions, is a configuration training runs
    assert megatron_bugs.summary()["findings megatron.training refuses"] == 1


def test_rotary_positions_under_pp_leave_no_table_to_sync(warm):
    """The same pp2 run without a learned position table: the position bug's only trigger."""
    result = audit([Case("mtp", ROPE, Layout(pp=2)), Case("gpt", (), Layout(pp=2))], run_pools=warm)
    assert result.findings == [] and not result.errors
    assert len(result.outcomes) == 2 and not result.not_swept and not result.not_applicable  # both ran


def _word_embeddings_synced_without_mtp(model, config, embd_group=None, pp_group=None):
    """The word-embedding all-reduce as it was before MTP kept a copy of the table (planted)."""
    if getattr(config, "mtp_num_layers", None):
        return  # planted: the MTP stage's copy of the word embeddings is not summed
    return _REAL_WORD_EMBEDDING_SYNC(model, config, embd_group, pp_group)


_REAL_WORD_EMBEDDING_SYNC = None


def test_a_reduction_dropped_from_the_mtp_path_is_found_at_the_planted_function(monkeypatch):
    global _REAL_WORD_EMBEDDING_SYNC
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    assert "_allreduce_word_embedding_grads" not in contracts._ORIGINALS  # ranks install probes
    _REAL_WORD_EMBEDDING_SYNC = finalize._allreduce_word_embedding_grads
    monkeypatch.setattr(finalize, "_allreduce_word_embedding_grads", _word_embeddings_synced_without_mtp)
    with pools() as planted:  # forked after the plant
        result = audit([Case("mtp", ROPE, Layout(pp=2)), Case("mtp", ROPE, Layout(tp=2))],
                       run_pools=planted)
    [finding] = result.findings
    start = inspect.getsourcelines(_word_embeddings_synced_without_mtp)[1]
    assert finding.location == f"{inspect.getsourcefile(_word_embeddings_synced_without_mtp)}:{start}"
    assert finding.trigger["layout"] == "pp2"
    assert finding.cases == [{"layout": "pp2", "options": {"position_embedding": "rope"}}]
    assert any("word_embeddings" in e["value"] for e in finding.effect)


def _finding(options, layout, contract=None):
    notation = contracts.BY_NAME[contract].notation() if contract else "outputs match the one-rank run"
    return Finding(title=f"mtp differs under {layout}", target="mtp", location="megatron/core/x.py:1",
                   contract=notation, layout=layout, config=options, observed=None, reference=None,
                   kind="numeric-only", checker=None, origin=AUDIT)


def _values(output, label):
    line = next(line for line in output.splitlines() if line.startswith(f"{label}:"))
    return [float(x) for x in line.split(":", 1)[1].replace("...", "").split(",") if x.strip()]


def _assert_fixed(path):
    result = run_repro(path, 2, launcher="direct", timeout=600, preload=MEGATRON_PRELOAD)
    assert (result.status, result.returncode) == (FIXED, 1), result.output
    assert _values(result.output, "observed") == pytest.approx(_values(result.output, "reference"), rel=1e-4)


def test_mtp_script_of_correct_code_finds_observed_equal_to_reference(tmp_path):
    _assert_fixed(write_audit_script(_finding({}, "tp2-sp"), tmp_path / "x.py"))


def test_mtp_script_reproduces_the_planted_word_embedding_bug_and_passes_without_it(tmp_path):
    finding = _finding(dict(ROPE), "pp2")
    path = write_audit_script(finding, tmp_path / "x.py")
    result = run_repro(path, 2, launcher="direct", timeout=600, preload=MEGATRON_PRELOAD,
                       env=planted_env(tmp_path / "site", MTP_WORD_EMBEDDINGS_NOT_SUMMED))
    assert (result.status, result.returncode) == (REPRODUCES, 0), result.output
    assert f"REPRODUCED {finding.id}" in result.output
    _assert_fixed(path)  # the control: the same script on the unchanged megatron-core


MEGATRON_BUGS = [pytest.param("cp2", (), "process_mtp_loss", marks=pytest.mark.skipif(
                     not HAS_PROCESS_MTP_LOSS, reason="process_mtp_loss came with megatron-core 0.17")),
                 pytest.param("pp2", LEARNED, "_allreduce_position_embedding_grads")]


@pytest.mark.release_specific
@pytest.mark.parametrize(("layout", "options", "contract"), MEGATRON_BUGS)
def test_mtp_script_reproduces_megatron_core_bug_then_exits_1_with_the_fix(layout, options, contract, tmp_path):
    finding = _finding(dict(options), layout, contract)
    path = write_audit_script(finding, tmp_path / "x.py")
    buggy = run_repro(path, 2, launcher="direct", timeout=600, preload=MEGATRON_PRELOAD)
    assert (buggy.status, buggy.returncode) == (REPRODUCES, 0), buggy.output
    reference = _values(buggy.output, "reference")
    assert _values(buggy.output, "observed") != pytest.approx(reference, rel=1e-4, abs=1e-6)
    assert _values(buggy.output, "corrected") == pytest.approx(reference, rel=1e-4, abs=1e-6)
    fixed = run_repro(path, 2, launcher="direct", timeout=600, preload=MEGATRON_PRELOAD, args=("--fixed",))
    assert (fixed.status, fixed.returncode) == (FIXED, 1), fixed.output
