"""The planning pass over Megatron's functional-test configs (``shardcheck.megatron.train.survey``).

No ranks start: each config is shrunk and planned as ``shardcheck train --model-config`` does
before it starts any. Run on the configs the repository carries, and on a few configs of the
full golden data set where it is there (skipped with the reason where not).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from megatron_metadata import NO_MEGATRON_TRAINING

if NO_MEGATRON_TRAINING:
    pytest.skip(NO_MEGATRON_TRAINING, allow_module_level=True)

from golden_data import data_root, full_data_root  # noqa: E402

from shardcheck.megatron.cpu.te import te_dir  # noqa: E402
from shardcheck.megatron.train.args import TrainInputError, plan_runs  # noqa: E402
from shardcheck.megatron.train.config import flags_from_model_config  # noqa: E402
from shardcheck.megatron.train.survey import (  # noqa: E402
    CRASHED,
    PLANNED,
    REFUSED,
    main,
    model_configs,
    plan_config,
    survey,
    table,
)

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--vocab-size", "1024"]
# the carried configs' classes: (class, the refusing flag)
CARRIED = {
    "gpt/gpt3_mcore_te_tp2_pp1_gdn": (PLANNED, ""),
    "gpt/gpt3_mcore_tp1_pp2_fp16": (PLANNED, ""),
    "hybrid/hybrid_dynamic_inference_tp1_pp1_dp8_2b_async_sched_async": (REFUSED, "--use-checkpoint-args"),
    "hybrid/hybrid_mr_mcore_te_tp1_pp1_cp1_dgx_a100_1N8G": (PLANNED, ""),
    "hybrid/hybrid_mr_mcore_te_tp2_pp1_cp1_dgx_a100_1N8G": (PLANNED, ""),
    "moe/gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4": (PLANNED, ""),
    "moe/gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router": (REFUSED, "--use-megatron-fsdp"),
    "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer": (PLANNED, ""),
}
needs_te = pytest.mark.skipif(not (te_dir() / "transformer_engine").is_dir(),
                              reason=f"transformer-engine is not installed in {te_dir()} (the GDN and hybrid "
                                     "configs build only on it)")


def _name(path: Path) -> str:
    return f"{path.parent.parent.name}/{path.parent.name}"


@needs_te
def test_the_carried_configs_plan_or_are_refused_in_one_line_and_none_crashes():
    outcomes = survey(model_configs([data_root() / "head"]))
    assert {_name(o.path): (o.kind, o.flag) for o in outcomes} == CARRIED
    assert all(o.kind != CRASHED and "\n" not in o.line for o in outcomes)
    assert table(outcomes)[2:] == ["| gpt | 2 | 2 | 0 | 0 |",
                                   "| hybrid | 3 | 2 | 1: `--use-checkpoint-args` 1 | 0 |",
                                   "| moe | 3 | 2 | 1: `--use-megatron-fsdp` 1 | 0 |"]


def test_the_command_prints_the_table_and_exits_0_without_a_crash(capsys):
    assert main([str(data_root() / "head" / "gpt"), "-v"]) == 0
    out = capsys.readouterr().out
    assert "gpt/gpt3_mcore_tp1_pp2_fp16: 4 ranks" in out and out.rstrip().endswith("| 0 |")


@pytest.mark.parametrize(("flags", "line"), [
    (["--use-flash-attn"], "--use-flash-attn dropped: flash attention is a CUDA kernel"),
    (["--te-rng-tracker"], "--te-rng-tracker dropped: Transformer Engine's RNG tracker holds CUDA generator states"),
    (["--defer-embedding-wgrad-compute"], "--defer-embedding-wgrad-compute dropped: Megatron defers the embedding's weight gradient only through"),
    (["--fine-grained-activation-offloading", "--offload-modules", "expert_fc1", "moe_act"],
     "--fine-grained-activation-offloading dropped: activation offloading moves activations to host memory"),
    (["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"],
     "--overlap-moe-expert-parallel-comm dropped: the expert-parallel all-to-all overlaps another micro-batch's"),
])
def test_a_flag_that_picks_a_kernel_rng_or_memory_placement_is_dropped_with_a_line_not_refused(flags, line):
    plan = plan_runs([*SMALL, *flags], 2, 1)
    assert not {flag for flag in flags if flag.startswith("--")} & set(plan.parallel + plan.reference)
    assert any(change.startswith(line) for change in plan.changes)


def test_the_flex_dispatcher_becomes_the_all_to_all_one_with_a_line():
    """Its DeepEP and HybridEP backends are CUDA kernels (deepseekv3_proxy_flex failed on
    'HybridEP is not installed')."""
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--expert-model-parallel-size", "2"]
    plan = plan_runs([*SMALL, *moe, "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend",
                      "hybridep"], 2, 1)
    for tokens in (plan.parallel, plan.reference):
        assert tokens[tokens.index("--moe-token-dispatcher-type") + 1] == "alltoall"
        assert "--moe-flex-dispatcher-backend" not in tokens
    assert any(line.startswith("--moe-token-dispatcher-type flex -> alltoall: the flex dispatcher's backends")
               for line in plan.changes)


@pytest.mark.parametrize("flag", ["--step-batch-size-schedule", "--rampup-batch-size"])
def test_a_batch_size_schedule_is_refused_in_one_line(flag):
    values = ["0:4 1B:8"] if flag == "--step-batch-size-schedule" else ["2", "2", "100"]
    with pytest.raises(TrainInputError, match=f"^{flag}: the global batch changes as training goes"):
        plan_runs([*SMALL, flag, *values], 2, 1)


@pytest.mark.parametrize(("flag", "values", "what"), [
    ("--img-h", ["336"], "vision and multimodal models"),
    ("--encoder-num-layers", ["2"], "encoder-decoder models (T5)"),
    ("--bert-no-binary-head", [], "BERT models"),
])
def test_another_model_familys_flag_is_refused_for_the_gpt_entry_point_and_left_to_an_entry_script(flag, values,
                                                                                                     what):
    with pytest.raises(TrainInputError, match=f"^{flag}: a flag of Megatron's {re.escape(what)}"):
        plan_runs([*SMALL, flag, *values], 2, 1, own_entry=True)
    plan_runs([*SMALL, flag, *values], 2, 1)  # an --entry script's to build


@pytest.mark.parametrize(("flags", "line"), [
    (["--fim-data"], "--fim-data: fill-in-the-middle rearranges the documents of real data files"),
    (["--error-injection-rate", "100", "--error-injection-type", "persistent_error"],
     "--error-injection-rate: Megatron's rerun machinery then injects errors into the results on purpose"),
])
def test_a_job_whose_runs_cannot_be_compared_is_refused_in_one_line(flags, line):
    with pytest.raises(TrainInputError, match=f"^{re.escape(line)}"):
        plan_runs([*SMALL, *flags], 2, 1)
    plan_runs([*SMALL, "--error-injection-rate", "0"], 2, 1)  # Megatron's default: nothing injected


def test_a_config_without_a_megatron_flag_is_refused_in_one_line(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text("MODEL_ARGS:\n  trainer.num_nodes: 1\n  data.micro_batch_size: 1\n")
    with pytest.raises(TrainInputError, match="none of its MODEL_ARGS is a flag of this megatron-core "
                                              r"\(e.g. trainer.num_nodes: a NeMo recipe's"):
        flags_from_model_config(path)


@pytest.mark.parametrize(("family", "script"), [("bert", "pretrain_bert.py"), ("t5", "pretrain_t5.py")])
def test_a_config_of_another_model_family_is_refused_unless_its_entry_script_is_given(tmp_path, family, script):
    """BERT's configs hold GPT flags only: the folder Megatron keeps them in names their model."""
    path = tmp_path / family / "a_test" / "model_config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("MODEL_ARGS:\n  --num-layers: 4\n  --hidden-size: 128\n  --num-attention-heads: 8\n"
                    "  --seq-length: 128\n  --max-position-embeddings: 128\n  --micro-batch-size: 2\n")
    with pytest.raises(TrainInputError, match=f"Megatron-LM trains with {script}; shardcheck's GPT entry point "
                                              "does not build them: give that script with --entry$"):
        flags_from_model_config(path)
    assert flags_from_model_config(path, own_entry=False).nproc == 2
    (tmp_path / "gpt").mkdir()
    gpt = path.parent.rename(tmp_path / "gpt" / "a_test") / "model_config.yaml"
    assert flags_from_model_config(gpt).nproc == 2


def test_a_config_keeps_a_one_value_flag_with_blanks_whole_and_leaves_out_its_batch_schedule(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text("MODEL_ARGS:\n  --num-layers: 4\n  --hidden-size: 128\n  --num-attention-heads: 8\n"
                    "  --seq-length: 128\n  --max-position-embeddings: 128\n  --micro-batch-size: 2\n"
                    '  --step-batch-size-schedule: "0:384 200B:768 400B:1152"\n'
                    '  --data-cache-path: "/a path/with blanks"\n')
    shrunk = flags_from_model_config(path)
    assert "--step-batch-size-schedule" not in shrunk.flags
    assert "--step-batch-size-schedule left out: one global batch size" in shrunk.mapping
    assert shrunk.flags[shrunk.flags.index("--data-cache-path") + 1] == "/a path/with blanks"
    plan_runs(shrunk.flags, shrunk.nproc, 1, own_entry=True)


@pytest.mark.parametrize(("name", "kind", "flag"), [
    ("gpt/gpt3_15b_8t_release", PLANNED, ""),  # its batch schedule "0:384 200B:768 ..." once broke the flags
    ("mixtral/mixtral_8x7b_alltoall_tp2pp4ep4_release", PLANNED, ""),  # --use-flash-attn, once refused
    # once planned as a GPT: their folders name models with entry scripts of their own
    ("multimodal-llava/multimodal_llava_mcore_te_tp1_pp1", REFUSED, "a functional test of Megatron's LLaVA models"),
    ("bert/bert_mcore_tp2_pp2", REFUSED, "a functional test of Megatron's BERT models"),
    ("gpt/gpt_dynamic_inference_tp1_pp1_583m_cuda_graphs_validation", REFUSED, "no MODEL_ARGS in it"),
    # their runs failed on the ranks (one line, exit 2) before these were refused while planning
    ("gpt/gpt3_mcore_reruns_persistent_1", REFUSED, "--error-injection-rate"),
    ("gpt/gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset", REFUSED, "--fim-data"),
])
def test_real_configs_the_survey_once_misplanned(name, kind, flag):
    outcome = plan_config(full_data_root() / "head" / name / "model_config.yaml")
    assert (outcome.kind, outcome.flag) == (kind, flag), outcome.line


def test_an_optimizer_from_a_package_that_is_not_installed_is_refused_in_one_line():
    from megatron.core.optimizer import HAVE_EMERGING_OPTIMIZERS

    if HAVE_EMERGING_OPTIMIZERS:
        pytest.skip("emerging-optimizers is installed: Muon builds")
    with pytest.raises(TrainInputError, match="^--optimizer muon: megatron-core builds it from the "
                                              "emerging-optimizers package, which is not installed"):
        plan_runs([*SMALL, "--optimizer", "muon"], 2, 1)


def test_a_learning_rate_schedule_in_samples_becomes_the_same_in_iterations():
    plan = plan_runs([*SMALL, "--global-batch-size", "4", "--train-samples", "400", "--lr-decay-samples", "390",
                      "--lr-warmup-samples", "8"], 2, 1)
    for tokens in (plan.parallel, plan.reference):
        assert "--lr-decay-samples" not in tokens and "--train-samples" not in tokens
        assert tokens[tokens.index("--lr-decay-iters") + 1] == "98"  # 390 samples, 4 a step, rounded up
        assert tokens[tokens.index("--lr-warmup-iters") + 1] == "2"
    assert "--lr-decay-samples 390 -> --lr-decay-iters 98: the runs count iterations, of 4 samples each" in plan.changes


def test_a_parallel_run_that_starts_from_the_one_rank_weights_checkpoints_in_torch_dist():
    """A torch-format checkpoint of one rank does not load into a pipeline: the runs once trained
    nothing (gpt3_mcore_te_tp1_pp4_vp1_decoupled_lr, --ckpt-format torch)."""
    pipeline = [*SMALL, "--num-layers", "4", "--pipeline-model-parallel-size", "2", "--ckpt-format", "torch"]
    plan = plan_runs(pipeline, 2, 1)
    assert plan.same_init
    for tokens in (plan.parallel, plan.reference):
        assert tokens[tokens.index("--ckpt-format") + 1] == "torch_dist"
    assert "--ckpt-format torch -> torch_dist: only Megatron's torch_dist checkpoints load into another layout" \
        in plan.changes
    unchanged = plan_runs([*SMALL, "--ckpt-format", "torch"], 2, 1)  # dp2: both runs initialise alike
    assert not unchanged.same_init and unchanged.parallel[unchanged.parallel.index("--ckpt-format") + 1] == "torch"


def test_an_overlap_megatron_allows_with_an_interleaved_pipeline_only_is_dropped_with_a_line():
    """The one-rank run has no pipeline; the parallel run loads the one-rank run's weights from a
    torch_dist checkpoint, which Megatron refuses the overlap with
    (gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather_overlap_optimizer)."""
    overlap = "--overlap-param-gather-with-optimizer-step"
    plan = plan_runs([*SMALL, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                      "--num-virtual-stages-per-pipeline-rank", "2", "--use-distributed-optimizer",
                      "--overlap-grad-reduce", "--overlap-param-gather", overlap], 2, 1)
    assert plan.same_init and overlap not in plan.reference + plan.parallel
    assert any(line.startswith(f"one-rank run: {overlap} dropped") for line in plan.changes)
    assert any(line.startswith(f"{overlap} dropped: Megatron refuses it with torch_dist") for line in plan.changes)


@pytest.mark.parametrize(("flags", "dropped"), [
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--overlap-p2p-communication-warmup-flush"], "--overlap-p2p-communication-warmup-flush"),
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
     "--num-distributed-optimizer-instances"),
], ids=["p2p-warmup-flush", "optimizer-instances"])
def test_what_megatron_allows_with_a_pipeline_or_data_parallel_ranks_only_is_dropped_on_one_rank(flags, dropped):
    """Megatron refused them on the one-rank run (tunable_overlap, multi_dist_optimizer_instances)."""
    plan = plan_runs([*SMALL, "--num-layers", "4", *flags], 2, 1)
    assert dropped in plan.parallel and dropped not in plan.reference
    assert any(line.startswith(f"one-rank run: {dropped} dropped: ") for line in plan.changes)


def test_a_split_that_counts_the_embedding_and_loss_as_layers_keeps_them_divisible(tmp_path):
    """(layers + 2) over 4 x 2 virtual stages: 6 layers, where 8 failed Megatron's check."""
    path = tmp_path / "model_config.yaml"
    path.write_text("MODEL_ARGS:\n  --num-layers: 30\n  --hidden-size: 128\n  --num-attention-heads: 8\n"
                    "  --seq-length: 128\n  --max-position-embeddings: 128\n  --micro-batch-size: 4\n"
                    "  --pipeline-model-parallel-size: 4\n  --num-virtual-stages-per-pipeline-rank: 2\n"
                    "  --account-for-embedding-in-pipeline-split: true\n  --account-for-loss-in-pipeline-split: true\n")
    shrunk = flags_from_model_config(path)
    assert shrunk.flags[shrunk.flags.index("--num-layers") + 1] == "6"
    assert ("--num-layers 30 -> 6: one layer per pipeline stage, the embedding and the loss counted as layers"
            in shrunk.mapping)


def test_virtual_pipeline_stages_are_kept_on_the_pipeline_and_dropped_on_one_rank():
    plan = plan_runs([*SMALL, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                      "--num-virtual-stages-per-pipeline-rank", "2"], 2, 1)
    assert "--num-virtual-stages-per-pipeline-rank" in plan.parallel
    assert "--num-virtual-stages-per-pipeline-rank" not in plan.reference


def test_a_virtual_pipeline_config_gets_at_least_one_micro_batch_per_pipeline_rank(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text("MODEL_ARGS:\n  --num-layers: 12\n  --hidden-size: 128\n  --num-attention-heads: 8\n"
                    "  --seq-length: 128\n  --max-position-embeddings: 128\n  --micro-batch-size: 4\n"
                    "  --global-batch-size: 32\n  --pipeline-model-parallel-size: 4\n"
                    "  --num-layers-per-virtual-pipeline-stage: 1\n")
    shrunk = flags_from_model_config(path)
    assert (shrunk.nproc, shrunk.flags[shrunk.flags.index("--global-batch-size") + 1]) == (8, "8")  # dp2, 4 each
    # Megatron wants a micro-batch group between the pipeline size and the micro-batches (tunable_overlap's 5)
    grouped = path.with_name("grouped.yaml")
    grouped.write_text(path.read_text() + "  --microbatch-group-size-per-virtual-pipeline-stage: 5\n")
    group = flags_from_model_config(grouped).flags
    assert group[group.index("--microbatch-group-size-per-virtual-pipeline-stage") + 1] == "4"
    plan_runs(shrunk.flags, shrunk.nproc, 1, own_entry=True)


def test_distributed_optimizer_instances_shrink_to_divide_the_dense_and_the_expert_data_parallel_sizes(tmp_path):
    """moe's 8experts2parallel_multi_dist_optimizer_instances at tp2 ep2 on 4 ranks has one expert data-parallel rank:
    Megatron asserted 'Expert data parallel size should be divisible by partial DistOpt shard factor'."""
    path = tmp_path / "model_config.yaml"
    base = ("MODEL_ARGS:\n  --num-layers: 2\n  --hidden-size: 128\n  --num-attention-heads: 8\n"
            "  --seq-length: 128\n  --max-position-embeddings: 128\n  --micro-batch-size: 1\n"
            "  --global-batch-size: 8\n  --tensor-model-parallel-size: 2\n  --use-distributed-optimizer: true\n"
            "  --num-distributed-optimizer-instances: 2\n")
    path.write_text(base)
    dense = flags_from_model_config(path)
    assert (dense.nproc, dense.flags[dense.flags.index("--num-distributed-optimizer-instances") + 1]) == (4, "2")
    path.write_text(base + "  --num-experts: 8\n  --moe-router-topk: 2\n  --expert-model-parallel-size: 2\n")
    experts = flags_from_model_config(path)
    assert experts.flags[experts.flags.index("--num-distributed-optimizer-instances") + 1] == "1"
    assert ("--num-distributed-optimizer-instances 2 -> 1: it must divide the data-parallel sizes, dense and expert"
            in experts.mapping)


def test_the_expert_activation_leaves_the_recomputed_modules_with_the_grouped_gemm():
    recompute = ["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "moe_act"]
    plan = plan_runs([*SMALL, "--num-experts", "4", "--moe-grouped-gemm", *recompute], 2, 1)
    assert plan.parallel[plan.parallel.index("--recompute-modules") + 1] == "layernorm"
    assert "moe_act" not in plan.parallel + plan.reference
    assert any(line.startswith("--recompute-modules layernorm moe_act -> layernorm: megatron-core recomputes")
               for line in plan.changes)


def test_sinkhorn_routing_says_that_the_split_changes_it():
    moe = ["--num-experts", "4", "--moe-router-topk", "1", "--disable-bias-linear"]
    plan = plan_runs([*SMALL, *moe, "--moe-router-load-balancing-type", "sinkhorn"], 2, 1)
    assert any(line.startswith("--moe-router-load-balancing-type sinkhorn: Megatron balances the routing over "
                               "the tokens one rank holds") for line in plan.reference_lines)
    assert not any("sinkhorn" in line for line in plan_runs([*SMALL, *moe], 2, 1).reference_lines)


def test_a_pipeline_layout_for_the_full_layer_count_is_left_out_with_a_line(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text("MODEL_ARGS:\n  --num-layers: 14\n  --hidden-size: 128\n  --num-attention-heads: 8\n"
                    "  --seq-length: 128\n  --max-position-embeddings: 128\n  --micro-batch-size: 4\n"
                    "  --pipeline-model-parallel-size: 2\n  --mtp-num-layers: 1\n"
                    '  --pipeline-model-parallel-layout: "Et*7|t*7mL"\n')
    shrunk = flags_from_model_config(path)
    assert "--pipeline-model-parallel-layout" not in shrunk.flags
    assert ("--pipeline-model-parallel-layout left out: the layers split evenly over the shrunk pipeline"
            in shrunk.mapping)
    plan_runs(shrunk.flags, shrunk.nproc, 1, own_entry=True)
