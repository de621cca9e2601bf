"""Recomputation in the audit: full, selective (each submodule megatron-core accepts) and with
activations distributed over tp, swept as option sets for every component with a config
(the MTP and MoE GPTs too) and under the explicit-group layouts; a crash in megatron-core's own
code on one rank (MTP with distributed activations) is a finding with a script that raises it;
the decoder's recomputation gathers its distributed activations over parallel_state's tp group,
which the checker sees under explicit groups; so does MTP's under FP8 on Transformer Engine
(te_checkpoint given parallel_state's tp group, #7452 finding 4), named at its call."""

import pytest

pytest.importorskip("megatron.core")

from shardcheck.fuzz.findings import Finding  # noqa: E402
from shardcheck.megatron.audit.findings import ONE_RANK_CONTRACT, ONE_RANK_CRASH  # noqa: E402
from shardcheck.megatron.audit.outcome import Outcome  # noqa: E402
from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD  # noqa: E402
from shardcheck.megatron.audit.sweep import (  # noqa: E402
    FULL_BUNDLES,
    SELECTIVE,
    Case,
    bundles,
    components_plan,
    layouts,
    option_bundles,
    recompute_modules,
    setup_kwargs,
    te_option_sets,
)
from shardcheck.megatron.cpu.te import te_dir  # noqa: E402
from shardcheck.megatron.repro.templates import script_body  # noqa: E402
from shardcheck.megatron.scenarios.gpt import MTPGPTSetup  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402
from shardcheck.parity.pool import PoolFailure, _failure, _user_traceback  # noqa: E402

DISTRIBUTED = FULL_BUNDLES[-1]  # full, uniform, activations distributed over tp
EXPLICIT = Layout.parse("tp2-dp2@dp-tp")
HAVE_TE = (te_dir() / "transformer_engine").is_dir()  # the pinned wheel `make` installs


def test_selective_recomputation_of_each_submodule_megatron_core_accepts_is_a_bundle():
    assert {"mlp", "layernorm", "moe"} <= set(recompute_modules())
    assert "core_attn" not in recompute_modules()  # the default: the single option selective
    assert (SELECTIVE, ("recompute_modules", "mlp")) in bundles()
    assert set(FULL_BUNDLES) <= set(bundles())
    # a list field is written as one string in a case, and reaches the config as a list
    options = (SELECTIVE, ("recompute_modules", "mlp,layernorm"))
    assert setup_kwargs(MTPGPTSetup, options)["config"]["recompute_modules"] == ["mlp", "layernorm"]


def test_prefixed_components_take_the_recomputation_bundles_under_explicit_groups():
    for component in ("gpt", "mtp", "moe"):
        taken = option_bundles(component)
        assert set(FULL_BUNDLES) <= set(taken), component
        assert (SELECTIVE, ("recompute_modules", "layernorm")) in taken, component
    planned = {(c.component, c.options, str(c.layout))
               for c in components_plan(["gpt", "mtp"], layouts(explicit=True))}
    for component in ("gpt", "mtp"):
        for bundle in FULL_BUNDLES:
            assert (component, bundle, str(EXPLICIT)) in planned, (component, bundle)


def _split_unevenly() -> None:
    from megatron.core.tensor_parallel.utils import split_tensor_along_last_dim

    split_tensor_along_last_dim(__import__("torch").ones(3), 2)


def _harness_error() -> None:
    raise ValueError("raised by the harness, not megatron-core")


def _one_rank(call) -> Outcome:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the exception is the subject
        failure = _failure(None, {0: _user_traceback(exc)}, [], {}, 30.0)
    assert isinstance(failure, PoolFailure)
    return Outcome.raised(Case("gpt", (("recompute_granularity", "selective"),), Layout()), failure)


def test_a_one_rank_crash_counts_only_when_megatron_core_raised_it():
    crash = _one_rank(_split_unevenly)
    assert crash.one_rank_crash and crash.frame.startswith("megatron/core/utils.py")
    assert not _one_rank(_harness_error).one_rank_crash


def test_a_one_rank_crash_gets_a_script_that_raises_it():
    finding = Finding.audited(
        {"component": "mtp", "options": dict(DISTRIBUTED), "layout": "tp1"}, [], None,
        title="mtp error on one rank", kind=ONE_RANK_CRASH,
        location="megatron/core/transformer/multi_token_prediction.py:1848",
        contract=f"{ONE_RANK_CONTRACT} (RuntimeError)")
    body = script_body(finding)
    assert "RAISED = ('RuntimeError', 'megatron/core/transformer/multi_token_prediction.py')" in body.code
    assert "def observed():" in body.code and "run_on(ONE_RANK)" in body.code
    assert not body.has_corrected


@pytest.mark.slow
def test_recomputation_findings_and_clean_controls():
    """One audit: recomputation under tp, sp and cp gives the one-rank numbers; the decoder's
    distributed activations under explicit groups are gathered over the global tp group (seen
    by the checker, repaired by the model's groups); MTP with them crashes on one rank; with
    one MTP layer under FP8 on TE, MTP's own checkpoint gathers them over the global tp group
    under explicit groups (found at its te_checkpoint call) and over the model's under plain ones."""
    for module in PRELOAD:
        __import__(module)
    selective = (SELECTIVE,)
    clean = [Case("gpt", selective, Layout(tp=2, sp=True)), Case("gpt", FULL_BUNDLES[1], Layout(tp=2, sp=True)),
             Case("gpt", DISTRIBUTED, Layout(tp=2)), Case("gpt", FULL_BUNDLES[0], Layout(cp=2)),
             Case("mtp", FULL_BUNDLES[0], Layout(tp=2))]
    # MTP's recomputation under FP8 on TE (te_checkpoint), plain and with explicit groups
    [(quantised, te_layouts)] = te_option_sets()["mtp"]
    assert te_layouts == ("tp2-dp2", str(EXPLICIT))
    on_te = [Case("mtp", quantised, Layout.parse(name)) for name in te_layouts] if HAVE_TE else []
    result = audit([*clean, *on_te, Case("gpt", DISTRIBUTED, EXPLICIT), Case("mtp", DISTRIBUTED, Layout(tp=2))])
    assert not result.errors, result.errors
    assert len(result.not_swept) == 1 and result.not_swept[0].startswith("mtp"), result.not_swept
    assert len(result.outcomes) == len(clean) + len(on_te) + 1  # the last MTP case stops at its one-rank reference
    assert sorted(f.kind for f in result.findings) == [ONE_RANK_CRASH, *["type+numeric"] * (1 + HAVE_TE)], [
        (f.kind, f.location) for f in result.findings]
    by_kind = {f.kind: f for f in result.findings if f.target == "gpt" or f.kind == ONE_RANK_CRASH}
    decoder = by_kind["type+numeric"]
    assert (decoder.target, decoder.layout, decoder.config) == ("gpt", str(EXPLICIT), dict(DISTRIBUTED))
    assert "global tp group" in decoder.checker and "tensor_parallel/utils.py" in decoder.checker
    # located where the fix goes: the line that checkpoints without the model's group
    assert decoder.location.startswith("megatron/core/recompute.py:"), decoder.location
    assert decoder.control["equal_to_reference"]
    crash = by_kind[ONE_RANK_CRASH]
    assert crash.location.startswith("megatron/core/transformer/multi_token_prediction.py:")
    assert crash.contract == f"{ONE_RANK_CONTRACT} (RuntimeError)"
    assert "Tensors must have same number of dimensions" in crash.title
    if not HAVE_TE:
        return
    # #7452 finding 4: MTP's te_checkpoint is given parallel_state's tp group; its gather of the
    # distributed activations mixes two data-parallel ranks' under explicit groups only
    [mtp] = [f for f in result.findings if f.target == "mtp" and f.kind == "type+numeric"]
    assert (mtp.layout, mtp.config) == (str(EXPLICIT), dict(quantised))
    assert "global tp group" in mtp.checker and "transformer_engine/pytorch/distributed.py" in mtp.checker
    assert mtp.location.startswith("megatron/core/transformer/multi_token_prediction.py:"), mtp.location
    assert "checkpoint_handler" in mtp.title, mtp.title
    assert mtp.control["equal_to_reference"]
