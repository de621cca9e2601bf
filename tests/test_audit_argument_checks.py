"""Real megatron-core exceptions, raised here in one process and reported as a rank pool reports
them, are told apart: megatron-core checking its arguments (a config's ``__post_init__``, a
constructor's assertion, a schedule refusing its config) is a refusal; an error deeper in the
code (a divisibility assertion in the middle of a computation, a shape mismatch in a forward)
stays a crash. And megatron.training's own ``validate_args`` is run on a finding's configuration:
it refuses MTP with learned absolute positions (the MTP position-embedding finding at pp2),
accepts it with rotary positions, and is not asked about a component ``pretrain_gpt`` does not
build."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from shardcheck.fuzz.findings import Finding  # noqa: E402
from shardcheck.megatron.audit import report as audit_report  # noqa: E402
from shardcheck.megatron.audit.outcome import CONFIG_REFUSES, Outcome  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.megatron.audit.training_args import (  # noqa: E402
    NOT_CHECKED,
    REFUSES,
    crash_training_verdict,
    loaded_validation,
    training_verdict,
)
from shardcheck.parity.layout import Layout  # noqa: E402
from shardcheck.parity.pool import PoolFailure, _failure, _user_traceback  # noqa: E402

CASE = Case("gpt", (), Layout(tp=2))


def _raised(call: Callable[[], object]) -> PoolFailure:
    """The failure a rank pool reports when ``call`` raises on rank 0."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the exception is the subject
        return _failure(None, {0: _user_traceback(exc)}, [], {}, 30.0)
    raise AssertionError("it did not raise")


def _config_check() -> object:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, recompute_granularity="full")


def _constructor_check() -> object:
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    return FusedScaleMaskSoftmax(True, True, AttnMaskType.causal, False, attention_mask_func, True, None)


class _Model(torch.nn.Module):
    def __init__(self, config: object) -> None:
        super().__init__()
        self.config = config


def _schedule_check() -> object:
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    model = _Model(ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                       overlap_p2p_comm=True))
    return forward_backward_pipelining_without_interleaving(
        forward_step_func=None, data_iterator=None, model=model, num_microbatches=2, seq_length=4,
        micro_batch_size=1)


def _torch_norm_check() -> object:
    """megatron-core's local norm checks its config in ``WrappedTorchNorm.__new__``."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               layernorm_zero_centered_gamma=True)
    return WrappedTorchNorm(config, hidden_size=32)


def _missing_cuda_extension() -> object:
    """A column-parallel linear layer asked for gradient accumulation fusion, whose CUDA
    extension this machine lacks (megatron-core checks it as it builds the layer)."""
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        return ColumnParallelLinear(4, 4, config=ModelParallelConfig(gradient_accumulation_fusion=True, use_cpu_initialization=True),
                                    init_method=torch.nn.init.zeros_, tp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _split_mid_computation() -> object:
    from megatron.core.tensor_parallel.utils import split_tensor_along_last_dim

    return split_tensor_along_last_dim(torch.zeros(2, 3), 2)


def _shape_mismatch_in_a_forward() -> object:
    from megatron.core.transformer.utils import attention_mask_func

    return attention_mask_func(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize(("call", "error", "frame"), [
    (_config_check, 'ValueError: Using recompute_granularity: full so recompute_method must be "block" or "uniform"',
     "transformer_config.py"),
    (_constructor_check, "AssertionError: both fp16 and bf16 flags cannot be active at the same time.",
     "fused_softmax.py"),
    (_schedule_check, "ValueError: Non-interleaved pipeline parallelism does not support overlapping p2p "
     "communication", "in forward_backward_pipelining_without_interleaving"),
    (_torch_norm_check, "AssertionError: zero_centered_gamma not supported by torch LayerNorm", "torch_norm.py"),
], ids=["config-post-init", "constructor-assertion", "schedule-refuses-its-config", "norm-new-assertion"])
def test_megatron_cores_own_argument_checks_are_refusals(call, error, frame):
    outcome = Outcome.raised(CASE, _raised(call))
    assert outcome.config_check and not outcome.crashed
    assert outcome.refusal.startswith(f"{CONFIG_REFUSES}: {error}"), outcome.refusal
    assert frame in outcome.frame and outcome.frame.startswith("megatron/core/")


@pytest.mark.parametrize(("call", "error", "frame"), [
    (_split_mid_computation, "AssertionError: 3 is not divisible by 2", "in ensure_divisibility"),
    (_shape_mismatch_in_a_forward, "RuntimeError: The size of tensor a (3) must match the size of tensor b (4)",
     "in attention_mask_func"),
], ids=["divisibility-outside-a-constructor", "shape-mismatch-in-a-forward"])
def test_an_error_deeper_in_the_code_stays_a_crash(call, error, frame):
    outcome = Outcome.raised(CASE, _raised(call))
    assert not outcome.config_check and outcome.refusal is None and outcome.crashed
    assert outcome.error.startswith(error) and outcome.frame.endswith(frame)


@pytest.fixture(scope="module")
def arguments():
    """megatron.training's arguments module (on megatron-core 0.16.1 it does not import: the
    0.19 megatron.training beside it needs 0.19's core)."""
    loaded = loaded_validation()
    if isinstance(loaded, str):
        pytest.skip(loaded)
    return loaded[0]


MTP_LEARNED = "Multi-Token Prediction (MTP) is not supported with learned_absolute position embedding type."
LEARNED = (("position_embedding", "learned_absolute"),)
DISTRIBUTED_RECOMPUTE = (("recompute_granularity", "full"), ("recompute_num_layers", 1),
                         ("recompute_method", "uniform"), ("distribute_saved_activations", True))


def test_the_mtp_position_embedding_finding_is_one_megatron_training_refuses(arguments):
    """#7452's MTP position-embedding bug at pp2 needs learned absolute positions, which
    validate_args refuses with MTP (and a later check of its own lists as supported)."""
    verdict = training_verdict(Case("mtp", LEARNED, Layout(pp=2)))
    assert verdict.startswith(f"{REFUSES}: AssertionError: {MTP_LEARNED}")
    path, line = verdict.rsplit(" (", 1)[1].removesuffix(" in validate_args)").split(":")
    assert path == "megatron/training/arguments.py"
    source = Path(arguments.__file__).read_text().splitlines()
    assert "assert args.position_embedding_type ==" in source[int(line) - 1]
    assert f"\n{verdict}\n" in (Path(__file__).parents[1] / "docs" / "audit.md").read_text()  # as shown there


def test_megatron_training_accepts_the_same_job_with_rotary_positions_and_the_gpts_defaults(arguments):
    assert training_verdict(Case("mtp", (("position_embedding", "rope"),), Layout(pp=2))) is None
    assert training_verdict(Case("mtp", (), Layout(pp=2))) is None  # the MTP GPT's default: rotary
    for layout in ("tp2", "pp2", "cp2", "tp2-dp2-sp", "tp2-cp2-sp@cp-tp"):
        assert training_verdict(Case("gpt", (), Layout.parse(layout))) is None, layout
    assert training_verdict(Case("moe", (), Layout.parse("tp2-pp2-sp"))) is None


def test_a_crash_on_one_rank_is_refused_only_where_every_layout_is(arguments):
    """A one-rank crash's run is the reference of its option set under every layout: one rank
    alone refuses distributed recomputation (it needs tp > 1), tp2 accepts it; MTP with learned
    positions is refused under every layout."""
    alone = Case("mtp", DISTRIBUTED_RECOMPUTE, Layout())
    assert "can distribute recomputed activations only across tensor model parallel groups" in training_verdict(alone)
    assert crash_training_verdict(alone) is None
    learned = Case("mtp", LEARNED + DISTRIBUTED_RECOMPUTE, Layout())
    assert crash_training_verdict(learned) == training_verdict(learned)
    assert MTP_LEARNED in crash_training_verdict(learned)


def test_a_case_on_transformer_engine_is_checked_against_the_te_its_ranks_run(arguments):
    """This process has no TE, so validate_args's TE version checks fail; a case on TE is
    checked as with the pinned TE 2.20.2 installed (FP4 needs TE 2.7)."""
    fp4 = (("position_embedding", "rope"), ("fp4", "e2m1"))
    assert "--fp4-format requires Transformer Engine" in training_verdict(Case("mtp", fp4, Layout(tp=2)))
    assert training_verdict(Case("mtp", (("impl", "te"), *fp4), Layout(tp=2))) is None


def test_a_component_pretrain_gpt_does_not_build_is_not_checked():
    assert training_verdict(Case("output_loss", (("parallel_output", False),), Layout(tp=2))) is None


def test_a_layout_megatron_cores_config_refuses_first_is_said_to_be_unchecked(arguments):
    verdict = training_verdict(Case("gpt", (("account_for_embedding_in_pipeline_split", True),), Layout(pp=2)))
    assert verdict.startswith(f"{NOT_CHECKED}: its TransformerConfig does not build (ValueError: ")


def test_the_refusal_is_on_the_finding_in_findings_json_and_report_md(arguments, tmp_path):
    case = Case("mtp", LEARNED, Layout(pp=2))
    finding = Finding.audited(audit_report.trigger(case), [], None, title="mtp: position embeddings differ",
                              kind="numeric-only", location="megatron/core/x.py:1", contract="c",
                              reproduce=audit_report.reproduce_command(case), training_args=training_verdict(case))
    audit_report.write(tmp_path, [finding], {})
    [entry] = json.loads((tmp_path / "findings.json").read_text())["findings"]
    assert entry["training_args"] == training_verdict(case)
    assert Finding.from_report(entry).training_args == entry["training_args"]
    assert f"- **training arguments**: {entry['training_args']}\n" in (tmp_path / "report.md").read_text()


def test_code_this_machine_lacks_is_not_a_one_rank_crash():
    """megatron-core's own error for a CUDA extension that is not installed, on one rank: what
    this machine lacks (listed as not swept), not a megatron-core bug."""
    failure = _raised(_missing_cuda_extension)
    outcome = Outcome.raised(Case("gpt", (), Layout()), failure)
    assert "CUDA extension" in outcome.error and outcome.in_megatron
    assert not outcome.one_rank_crash
