"""Megatron's SSM layers on real Gloo ranks against one rank, with the plain-torch kernels."""

from contextlib import contextmanager, nullcontext
from functools import partial

import pytest

pytest.importorskip("megatron.core")

from shardcheck.megatron.cpu.runner import relative_errors, run_layout, run_ranks  # noqa: E402
from shardcheck.megatron.scenarios import ssm  # noqa: E402
from shardcheck.parity.launch import spawn_ranks  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402
from shardcheck.typecheck.checker import confirmed_across_ranks  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

GDN = partial(ssm.gdn_step, setup=ssm.GDNSetup())


@pytest.fixture(scope="module")
def gdn_reference():
    return run_layout(GDN, Layout())


def _within(errors, tolerance=1e-5, skip=()):
    return {name: e for name, e in errors.items() if e > tolerance and name not in skip}


def test_gdn_under_tp2_with_sequence_parallelism_matches_one_rank(gdn_reference):
    errors = relative_errors(run_layout(GDN, Layout.parse("tp2-sp")), gdn_reference)
    assert not _within(errors)
    assert gdn_reference["grad_replica_spread"] == 0


@contextmanager
def _out_norm_grads_summed_over_tp():
    """The fix: sum GatedDeltaNet's ``out_norm`` gradients over tp, as Megatron does for
    q/k layernorms (each TP rank normalises only its own heads with the shared weight)."""
    import importlib

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    original = finalize._allreduce_non_tensor_model_parallel_grads

    def fixed(model, config, tp_group=None):
        original(model, config, tp_group)
        if config.sequence_parallel:
            return
        for chunk in model:
            for name, param in chunk.named_parameters():
                if "out_norm" in name and param.main_grad is not None:
                    dist.all_reduce(param.main_grad, group=ps.get_tensor_model_parallel_group())

    finalize._allreduce_non_tensor_model_parallel_grads = fixed
    try:
        yield
    finally:
        finalize._allreduce_non_tensor_model_parallel_grads = original


def gdn_with_out_norm_fix(ctx):
    with _out_norm_grads_summed_over_tp():
        return GDN(ctx)


def test_gdn_out_norm_gradient_is_not_reduced_over_tp_without_sequence_parallelism(gdn_reference):
    """A Megatron bug: finalize_model_grads sums norm gradients over tp only for sequence-parallel
    norms and q/k layernorms, so without SP each TP rank keeps its own heads' share."""
    ranks = run_ranks(GDN, Layout.parse("tp2"))
    errors = relative_errors(ranks[0], gdn_reference)
    assert errors["grad/out_norm.weight"] > 0.1
    assert ranks[0]["grad_replica_spread"] > 1e-3  # the TP replicas of the weight drift apart
    assert not _within(errors, skip=("grad/out_norm.weight", "grad_replica_spread"))
    corrected = relative_errors(run_layout(gdn_with_out_norm_fix, Layout.parse("tp2")), gdn_reference)
    assert not _within(corrected)


GDN_BIASED = partial(ssm.gdn_step, setup=ssm.GDNSetup(bias=True))


@contextmanager
def _in_proj_bias_split_like_its_weight():
    """The fix: describe in_proj.bias in the checkpoint as in_proj.weight is, per section
    (each TP rank holds its share of query, key, value, z, beta and alpha, not a contiguous
    slice of their concatenation)."""
    from megatron.core.ssm import gated_delta_net as gdn

    original = gdn.GatedDeltaNet.sharded_state_dict

    def fixed(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        state = original(self, prefix, sharded_offsets, metadata, tp_group)
        tp = self.tp_size
        sections = [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp, self.v_dim // tp,
                    self.num_value_heads // tp, self.num_value_heads // tp]
        names = ["query", "key", "value", "z", "beta", "alpha"]
        split = original.__globals__["_split_tensor_factory"]  # where the method reads it
        state[f"{prefix}in_proj.bias"] = split(
            state[f"{prefix}in_proj.bias"], sections, names, 0)
        return state

    gdn.GatedDeltaNet.sharded_state_dict = fixed
    try:
        yield
    finally:
        gdn.GatedDeltaNet.sharded_state_dict = original


def gdn_biased_with_bias_metadata_fix(ctx):
    with _in_proj_bias_split_like_its_weight():
        return GDN_BIASED(ctx)


def test_gdn_in_proj_bias_checkpoint_metadata_is_a_contiguous_slice_not_per_section():
    """A Megatron bug: GatedDeltaNet.sharded_state_dict splits in_proj.weight per section but
    leaves in_proj.bias as a plain TP slice, so a checkpoint resharded across TP sizes (here:
    global weights loaded through that metadata) gives each rank the wrong bias entries."""
    reference = run_layout(GDN_BIASED, Layout())
    broken = relative_errors(run_layout(GDN_BIASED, Layout.parse("tp2-sp")), reference)
    assert broken["output"] > 0.05 and broken["grad/in_proj.weight.query"] > 0.05
    fixed_reference = run_layout(gdn_biased_with_bias_metadata_fix, Layout())
    assert "grad/in_proj.bias.query" in fixed_reference and "grad/in_proj.bias" in reference
    fixed = relative_errors(run_layout(gdn_biased_with_bias_metadata_fix, Layout.parse("tp2-sp")),
                            fixed_reference)
    assert not _within(fixed)


def _checker_lines(ctx_layout: Layout, steps: list, bias_metadata_fixed: bool = False) -> list:
    """Per step, the type checker's violations in megatron-core on this rank."""
    import torch.distributed as dist

    from shardcheck.megatron.checks import contracts
    from shardcheck.megatron.checks.typecheck import checked_region
    from shardcheck.megatron.cpu.runner import RankContext
    from shardcheck.parity.scenario import build_groups

    contracts.install()
    ctx = RankContext(ctx_layout, dist.get_rank(), build_groups(ctx_layout, dist.get_rank()))
    found = []
    for step in steps:
        with _in_proj_bias_split_like_its_weight() if bias_metadata_fixed else nullcontext(), \
                checked_region(ctx) as violations:
            step(ctx)
        found.append(violations)
    return found


def _confirmed(layout: str, steps: list, bias_metadata_fixed: bool = False) -> list[list[str]]:
    """Per step, the checker lines every rank agrees on (as the audit confirms them)."""
    per_rank = spawn_ranks(_checker_lines, 2, Layout.parse(layout), steps, bias_metadata_fixed)
    return [[v["line"] for v in confirmed_across_ranks(ranks)] for ranks in zip(*per_rank, strict=True)]


UNINITIALISED = {"perform_initialization": False}  # Megatron leaves the TP attributes unset


def _out_norm_unreduced(line: str) -> bool:
    """The checker's line for #7452 finding 11: GDN's out_norm gradient left partial over tp
    (without sequence parallelism), reported where the norm is built."""
    return (line.startswith("checker: unreduced gradient at megatron/core/ssm/gated_delta_net")
            and "out_norm.weight: parameter R on tp, gradient P" in line)


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
def test_gdn_and_mamba_conv_paths_type_clean_with_or_without_weight_initialisation(layout):
    """GatedDeltaNet's conv1d multiplies its sectioned weight by the qkv cut from in_proj's
    fused output: no violation, also when in_proj's weight lacks tensor_model_parallel (the
    checker used to take it for replicated and blame the conv: a false positive). Under tp2
    without sequence parallelism the one line is the out_norm gradient's, a real bug."""
    steps = [GDN, partial(ssm.gdn_step, setup=ssm.GDNSetup(config=UNINITIALISED)),
             partial(ssm.mamba_step, setup=ssm.MambaSetup(config=UNINITIALISED))]
    confirmed = _confirmed(layout, steps)
    gdn_lines = [[line for line in lines if not _out_norm_unreduced(line)] for lines in confirmed[:2]]
    assert gdn_lines == [[], []] and confirmed[2] == [], confirmed
    assert all(len(lines) == (1 if layout == "tp2" else 0) for lines in confirmed[:2]), confirmed


def test_checker_flags_gdn_in_proj_bias_cut_as_one_slice_and_not_its_fix():
    """The in_proj bias metadata bug in types: the fused output (per-section pieces) plus a bias
    cut as one slice of the concatenation do not line up; with the bias split per section
    they do."""
    (broken,) = _confirmed("tp2", [GDN_BIASED])
    mixed = broken[0]  # the first line; the gradients it reaches are no longer typed after it
    assert mixed.startswith("checker: mixed shards at megatron/core/tensor_parallel/")
    assert "aten.add.Tensor: {tp:S(2, sections=[8, 8, 16, 16, 4, 4])}, {tp:S(0)}" in mixed
    [(fixed,)] = _confirmed("tp2", [GDN_BIASED], bias_metadata_fixed=True)
    assert _out_norm_unreduced(fixed)


MAMBA = partial(ssm.mamba_step, setup=ssm.MambaSetup())


@pytest.mark.parametrize("layout", ["tp2-sp", "cp2", "tp2"])
def test_mamba_mixer_matches_one_rank(layout, mamba_reference):
    errors = relative_errors(run_layout(MAMBA, Layout.parse(layout)), mamba_reference)
    assert not _within(errors)


@pytest.fixture(scope="module")
def mamba_reference():
    return run_layout(MAMBA, Layout())


MAMBA_UNFUSED = partial(ssm.mamba_step, setup=ssm.MambaSetup(config={"use_mamba_mem_eff_path": False}))


def test_mamba_fused_kernel_equals_megatrons_unfused_path(mamba_reference):
    """The split-conv-scan kernel against Megatron's own unfused code path (its split, the conv,
    the scan and the gated norm called one by one)."""
    errors = relative_errors(run_layout(MAMBA_UNFUSED, Layout()), mamba_reference)
    assert not _within(errors)


@pytest.mark.parametrize("layout", [Layout(cp=2), Layout(dp=2)], ids=str)
def test_mamba_with_per_token_loss_matches_one_rank(layout):
    """Per-token loss: Megatron neither scales by the cp size nor averages over dp x cp."""
    from shardcheck.megatron.scenarios import scenario

    per_token = scenario("mamba", config={"calculate_per_token_loss": True})
    errors = relative_errors(run_layout(per_token, layout), run_layout(per_token, Layout()))
    assert max(errors.values()) < 1e-5, errors



# ---- under explicit process groups -----------------------------------------------------------

@pytest.mark.slow
def test_gdn_takes_explicit_groups_clean_where_megatron_is_right():
    """GDN gets the explicit pg_collection (and DDP and finalize_model_grads with it): clean
    under explicit groups with sequence parallelism; without it, its out_norm gradient is
    left unreduced over tp, as under the plain tp2 (GDN refuses context parallelism)."""
    from shardcheck.megatron.audit.run import audit
    from shardcheck.megatron.audit.sweep import Case
    from shardcheck.megatron.scenarios import COMPONENTS

    assert COMPONENTS["gdn"].explicit_groups
    result = audit([Case("gdn", (), Layout.parse(t)) for t in ["tp2", "tp2-dp2-sp@dp-tp", "tp2-dp2@dp-tp"]])
    assert not result.errors, [o.error for o in result.errors]
    assert {str(o.case.layout) for o in result.outcomes if o.failed} == {"tp2", "tp2-dp2@dp-tp"}
    [finding] = result.findings
    assert finding.location.startswith("megatron/core/ssm/gated_delta_net")  # 0.19: a package
    assert {c["layout"] for c in finding.cases} == {"tp2", "tp2-dp2@dp-tp"}


@pytest.mark.slow
def test_mamba_takes_explicit_groups_and_matches_one_rank_or_says_why_not():
    """The Mamba mixer under explicit groups, with an option: the parallel runs agree with one
    rank on 0.19 and later, and type clean (at tp2-cp2-sp@cp-tp, where cp is the faster axis,
    the per-head parameters sliced by the cp rank gave 11 type-only entries while the numbers
    agreed); a release whose mixer disagrees there for a reason not pinned down refuses the
    layouts in one line, before any rank starts."""
    from shardcheck.megatron.audit.run import audit
    from shardcheck.megatron.audit.sweep import Case
    from shardcheck.megatron.cpu.versions import mamba_takes_conv_module
    from shardcheck.megatron.scenarios import COMPONENTS

    assert COMPONENTS["mamba"].explicit_groups
    texts = ["tp2-dp2@dp-tp", "tp2-cp2-sp@cp-tp", "cp2-dp2@dp-cp"]
    cases = [Case("mamba", options, Layout.parse(t)) for t in texts
             for options in ((), (("d_has_hdim", True),))]
    result = audit(cases)
    if mamba_takes_conv_module():
        assert result.outcomes == [] and len(result.not_applicable) == len(texts), result.not_applicable
        assert all("not pinned down" in line for line in result.not_applicable)
        return
    assert not result.errors, [o.error for o in result.errors]
    assert len(result.outcomes) == len(cases) and result.findings == []
    assert not any(o.failed for o in result.outcomes)
