"""The audit's implementation dimension (``impl``: local or te): cases on Transformer Engine's own
layers, run on rank pools that installed TE before importing megatron-core.

A copy of megatron-core whose ``extensions/transformer_engine.py`` marks the expert weights of
the MoE's TE linears as no tensor-parallel shards (the #5916 class: the gradient norm counts
only tp rank 0's piece of them) is found through the gradient norm's accounting, named at the
planted line; the same copy unplanted gives no finding for the TE GPT and MoE at tp2, tp2-sp,
dp2, pp2 and tp2-dp2-ep2-sp.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

core = pytest.importorskip("megatron.core")

from shardcheck.megatron.audit.outcome import Outcome  # noqa: E402
from shardcheck.megatron.audit.report import title  # noqa: E402
from shardcheck.megatron.audit.sweep import (  # noqa: E402
    TE_LAYOUTS,
    Case,
    components_plan,
    impl_of,
    in_te_tier,
    layouts,
    setup_options,
    te_option_sets,
)
from shardcheck.megatron.cpu.te import te_dir  # noqa: E402
from shardcheck.megatron.scenarios.gpt import GPTSetup, MoEGPTSetup, TEGPTSetup  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TE_FILE = Path("megatron/core/extensions/transformer_engine.py")
# Megatron's marking of an expert TE linear's parameters (_set_expert_parameter_attributes):
# weights and column-parallel biases are tp shards. Planted: only the biases are.
MARKED = "param.tensor_model_parallel = is_partitioned\n"
PLANTED = "param.tensor_model_parallel = is_partitioned and is_bias  # planted: expert weights not tp shards\n"
CORRECT_LAYOUTS = "tp2,tp2-sp,dp2,pp2,tp2-dp2-ep2-sp"
needs_te = pytest.mark.skipif(not (te_dir() / "transformer_engine").is_dir(),
                              reason=f"transformer-engine is not installed in {te_dir()}")


def test_impl_is_a_setup_field_of_the_gpt_family_and_the_ssm_mixers_not_swept_as_an_option():
    assert (GPTSetup().layer_spec, TEGPTSetup().layer_spec) == ("local", "transformer_engine")
    assert MoEGPTSetup(impl="te").layer_spec == "transformer_engine"
    from shardcheck.megatron.scenarios.ssm import GDNSetup, MambaSetup

    assert GDNSetup(impl="te").impl == MambaSetup(impl="te").impl == "te"
    assert not any(name == "impl" for setup in (GPTSetup, MoEGPTSetup, GDNSetup, MambaSetup)
                   for name, _ in setup_options(setup))
    assert (impl_of(()), impl_of((("impl", "te"), ("loss_mask", True)))) == ("local", "te")


def test_the_default_plan_runs_the_defaults_on_te_at_a_few_layouts_after_the_defaults_tier():
    every = layouts(explicit=True)
    planned = components_plan(["gpt", "moe", "gdn"], every)
    te = [case for case in planned if impl_of(case.options) == "te"]
    defaults = [case for case in te if case.options == (("impl", "te"),)]
    assert [(c.component, str(c.layout)) for c in defaults] == [
        (component, name) for component in ("gpt", "moe", "gdn") for name in TE_LAYOUTS[component]]
    # then the option sets of te_option_sets (the GPT's packed sequences), at their layouts
    assert [(c.component, c.options, str(c.layout)) for c in te[len(defaults):]] == [
        (component, options, name) for component in ("gpt", "moe", "gdn")
        for options, names in te_option_sets().get(component, ()) for name in names]
    first = planned.index(te[0])
    assert all(not c.options for c in planned[:first]) and len(planned[:first]) > len(every)
    assert planned[first:first + len(te)] == te
    assert components_plan(["gpt"], [Layout.parse("tp2")]).count(Case("gpt", (("impl", "te"),), Layout(tp=2))) == 1
    assert not any(impl_of(c.options) == "te" for c in components_plan(["gdn", "gpt"], [Layout.parse("cp2")]))


def test_the_te_tier_runs_mtp_recomputation_under_fp8_plain_and_with_explicit_groups():
    """MTP's quantised recomputation (te_checkpoint) is reachable on TE only: the TE tier runs it
    after MTP's defaults on TE, at tp2-dp2 and tp2-dp2@dp-tp, in the default plan."""
    from shardcheck.megatron.audit.schedule import in_default_plan

    [(options, names)] = te_option_sets()["mtp"]
    assert dict(options)["fp8"] and dict(options)["distribute_saved_activations"] and impl_of(options) == "te"
    te = [c for c in components_plan(["mtp"], layouts(explicit=True)) if impl_of(c.options) == "te"]
    assert [(c.options, str(c.layout)) for c in te] == [
        *(((("impl", "te"),), name) for name in TE_LAYOUTS["mtp"]), *((options, name) for name in names)]
    assert all(in_te_tier(c) and in_default_plan(c) for c in te)
    assert not in_te_tier(Case("mtp", options, Layout(tp=2)))


def test_the_te_tier_runs_the_gpt_on_packed_sequences_in_bf16_plain_and_with_explicit_groups():
    """Packed sequences (THD) run on TE's attention only, so in the TE tier: bf16 (TE's fused
    attention on them), the packed row split by sp, and whole packed micro-batches per dp rank
    under explicit groups; the local spec's refusal stays listed as not swept."""
    from shardcheck.megatron.audit.schedule import in_default_plan

    [(options, names)] = te_option_sets()["gpt"]
    assert dict(options) == {"impl": "te", "packed_sequences": True, "bf16": True}
    assert names == ("tp2-sp", "tp2-dp2@dp-tp")
    te = [c for c in components_plan(["gpt"], layouts(explicit=True)) if c.options == options]
    assert [str(c.layout) for c in te] == list(names)
    assert all(in_te_tier(c) and in_default_plan(c) for c in te)
    assert not in_te_tier(Case("gpt", options, Layout(dp=2)))


def _outcome(declared: dict[str, str], *wrong: str, clip: tuple[float, float] | None = None) -> Outcome:
    from shardcheck.megatron.audit.divergence import Gap

    gaps = [Gap("norm_counted/w1", 0.5, 1.0, 0.5, 0.5, 1e-6), Gap("norm_counted/w2", 0.1, 1.0, 0.9, 0.9, 1e-6),
            *(Gap(name, 1.0, 1.1, 0.1, 0.1, 1e-6) for name in wrong)]
    if clip is not None:
        gaps.append(Gap("clip_factor", *clip, 0.1, 0.1, 1e-6))
    return Outcome(Case("moe", (("impl", "te"),), Layout(tp=2, sp=True)), gaps, declared=declared)


def test_a_miscounted_parameter_in_the_norm_is_named_where_megatron_declared_its_tp_sharding():
    where = "has tensor_model_parallel=False from megatron/core/x.py:12 in mark"
    declared = {"w1": "has no tensor_model_parallel (built at megatron/core/y.py:3 in __init__)", "w2": where}
    shown = title(("loc", "contract"), _outcome(declared))
    assert shown == ("moe: norm_counted/w1 differs from one rank under tp2-sp (impl=te); "
                     f"the norm counts w2, which {where}")  # the one furthest off
    assert title(("loc", "contract"), _outcome({})).endswith("(impl=te)")
    # a wrong gradient is what the norm counts wrongly then, not the declaration
    assert title(("loc", "contract"), _outcome(declared, "grad/w2")).endswith(
        "; the norm counts w1, which " + declared["w1"])
    assert title(("loc", "contract"), _outcome(declared, "grad/w1", "grad/w2")).endswith("(impl=te)")
    # a changed clipping factor scales every counted gradient alike: w1 (counted x0.5 as every
    # other) is counted right, w2 is not
    clipped = title(("loc", "contract"), _outcome(declared, clip=(0.5 ** 0.5, 1.0)))
    assert clipped.endswith("; the norm counts w2, which " + where)
    assert title(("loc", "contract"), _outcome(declared, "grad/w2", clip=(0.5 ** 0.5, 1.0))).endswith("(impl=te)")


@pytest.fixture(scope="module")
def megatron_copy(tmp_path_factory) -> Path:
    """A copy of the installed megatron/core (the audit's --megatron tree)."""
    tree = tmp_path_factory.mktemp("megatron-copy")
    shutil.copytree(Path(core.__file__).parent, tree / "megatron" / "core",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if (tree / TE_FILE).read_text().count(MARKED) != 1:
        pytest.skip("this megatron-core marks its expert TE parameters otherwise")
    return tree


def _audit(tree: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "shardcheck", "audit", "--megatron", str(tree), "--out",
                           str(out), "--root", str(out / "store"), "--set", "impl=te", *args],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    return done, json.loads((out / "findings.json").read_text())


@needs_te
def test_a_correct_te_gpt_and_moe_give_no_finding(megatron_copy, tmp_path):
    done, data = _audit(megatron_copy, tmp_path, "--only", "gpt", "--only", "moe", "--layouts", CORRECT_LAYOUTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert data["findings"] == [] and data["summary"]["cases failed to run"] == 0, data["summary"]
    # gpt under every layout but the expert-parallel one; moe under those with sp or without tp
    assert data["summary"]["cases run"] == 8, data["summary"]
    # the cases share warm TE ranks, and each types as when it runs first (gpt: 98.7% to 100%);
    # dp2 and pp2, after tp2, typed about half their ops (TE's causal mask cached under tp2)
    shares = {layout: ops["typed_share"] for layout, ops in data["coverage"]["gpt"]["megatron_ops"]["by_layout"].items()}
    assert len(shares) == 4 and min(shares.values()) >= 0.98, shares


@needs_te
def test_an_expert_weight_not_marked_tensor_parallel_is_found_by_the_gradient_norm(megatron_copy, tmp_path):
    source = megatron_copy / TE_FILE
    text = source.read_text()
    lines = text.splitlines(keepends=True)
    number = next(n for n, line in enumerate(lines, 1) if line.endswith(MARKED))
    source.write_text(text.replace(MARKED, PLANTED))
    try:
        done, data = _audit(megatron_copy, tmp_path, "--only", "moe", "--layouts", "tp2-sp,tp2-dp2-ep2-sp")
    finally:
        source.write_text(text)
    assert done.returncode == 1, done.stdout + done.stderr  # found
    [finding] = data["findings"]
    assert finding["trigger"] == {"component": "moe", "options": {"impl": "te"}, "layout": "tp2-sp"}
    assert finding["seen_in"][0] == "layouts: tp2-sp, tp2-dp2-ep2-sp"
    # the line that declared the weight's tensor parallelism, where the fix goes (not the norm)
    assert finding["location"] == f"{TE_FILE}:{number}", finding["location"]
    counted = {e["value"] for e in finding["effect"]} & {
        f"norm_counted/decoder.layers.mlp.experts.experts.linear_fc{n}.weight" for n in (1, 2)}
    assert counted, finding["effect"]
    assert (f"which has tensor_model_parallel=False from {TE_FILE}:{number} in "
            "_set_expert_parameter_attributes") in finding["title"], finding["title"]


def test_without_transformer_engine_a_te_job_fails_in_one_line(monkeypatch, tmp_path):
    from shardcheck.megatron.audit.hosted import TEHost
    from shardcheck.parity.pool import PoolFailure

    monkeypatch.setenv("SHARDCHECK_TE_DIR", str(tmp_path))
    host = TEHost(timeout=30, preload=())
    try:
        with pytest.raises(PoolFailure, match="TransformerEngineMissing: transformer-engine .* is not installed in"):
            host.run(Layout(), print)
    finally:
        assert host.close() == 0  # the host exits when its parent closes the pipes
