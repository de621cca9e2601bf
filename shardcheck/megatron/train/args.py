"""The user's Megatron training flags, made runnable on CPU ranks and as a one-rank reference.

:func:`plan_runs` takes the flags after ``--`` and returns the arguments of the N-rank run and
of its one-rank run, with one line per flag it changed or could not honour on a CPU. A flag
that cannot run here at all (FP8, Transformer Engine's communication overlap, flash attention)
or that Megatron does not know raises :class:`TrainInputError` with one line.

``--transformer-impl transformer_engine``, given explicitly, is kept: the ranks run Transformer
Engine's own modules on shardcheck's CPU kernels (:mod:`shardcheck.megatron.cpu.te`). Without
the flag (or without TE's CPU layer installed) the runs use Megatron's local layers, with a line.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PARALLEL_SIZES = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                  "--context-parallel-size", "--expert-model-parallel-size",
                  "--expert-tensor-parallel-size")
PIPELINE_SPLITS = ("--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
                   "--microbatch-group-size-per-virtual-pipeline-stage",
                   "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                   "--pipeline-model-parallel-layout", "--account-for-embedding-in-pipeline-split",
                   "--account-for-loss-in-pipeline-split")
# what Megatron allows with a pipeline or several data-parallel ranks only: dropped on one rank
PARALLEL_ONLY = {
    "--overlap-param-gather-with-optimizer-step": ("Megatron overlaps the parameter gather with the optimizer "
                                                    "step under an interleaved pipeline only; the same math"),
    "--overlap-p2p-communication-warmup-flush": ("Megatron overlaps the pipeline's sends and receives in its "
                                                 "warmup and flush only with a pipeline; the same math"),
    "--num-distributed-optimizer-instances": ("each instance of the distributed optimizer holds its state over a "
                                              "share of the data-parallel ranks, and one rank has one; the same math"),
}
NOT_WITH_TORCH_DIST = ("--overlap-param-gather-with-optimizer-step",)  # Megatron refuses them together
# how context parallelism communicates: nothing to do on one rank
CONTEXT_PARALLEL_SPLITS = ("--cp-comm-type", "--hierarchical-context-parallel-sizes")
# flags whose CUDA code has no CPU path: refused, with the reason
IMPOSSIBLE = {
    "--fp8-format": "FP8 needs Transformer Engine on a GPU",
    "--fp4-format": "FP4 needs Transformer Engine on a GPU",
    "--tp-comm-overlap": "tensor-parallel communication overlap needs Transformer Engine's userbuffers",
    "--enable-cuda-graph": "CUDA graphs need a GPU",
    "--use-megatron-fsdp": "Megatron-FSDP's CPU path is not supported here",
}
HYBRID_PATTERNS = ("--hybrid-layer-pattern", "--hybrid-override-pattern")  # HybridModel's layers
# model-shaping flags shardcheck's own entry point does not build yet: refused (Megatron-LM's
# pretrain_gpt.py, given with --entry, builds them; the model check guards what slips through)
NOT_BUILT = {"--spec": "a layer spec module named by --spec",
             "--sft": "Megatron's SFT data (conversations packed into sequences, the prompts masked from the loss)"}
HETEROGENEOUS_PATH, HETEROGENEOUS_JSON = "--heterogeneous-layers-config-path", "--heterogeneous-layers-config-encoded-json"
# flags of Megatron's other model families (besides its vision group): their entry scripts build them
OTHER_MODELS = {**dict.fromkeys(("--encoder-num-layers", "--encoder-seq-length"), "encoder-decoder models (T5)"),
                "--bert-no-binary-head": "BERT models"}
# model-shaping flags megatron-core 0.19.2 builds only with Transformer Engine, and why
TE_ONLY = {
    "--experimental-attention-variant": ("megatron-core builds experimental attention variants (gated delta net, "
                                         "sparse attention) only with Transformer Engine"),
    "--multi-latent-attention": ("megatron-core's local multi-latent attention spec does not build (its local "
                                 "DotProductAttention takes no k_channels)"),
    **dict.fromkeys(HYBRID_PATTERNS, "megatron-core's hybrid stack spec is Transformer Engine's, and its HybridStack "
                                     "builds its final norm with TENorm"),
}
# --spec values that name megatron-core's own hybrid stack spec: what the entry point builds anyway
HYBRID_SPECS = {(module, name) for module in ("megatron.core.models.hybrid.hybrid_layer_specs",
                                              "megatron.core.models.mamba.mamba_layer_specs")
                for name in ("hybrid_stack_spec", "mamba_stack_spec")}
TE = "transformer_engine"
# Transformer Engine's attention backends that run on its CPU kernels
TE_ATTENTION_BACKENDS = ("auto", "unfused", "local")
# flags that select a fused CUDA kernel: switched to Megatron's plain torch path
UNFUSED = {
    "--no-gradient-accumulation-fusion": "gradient-accumulation fusion is a CUDA extension",
    "--no-persist-layer-norm": "the persistent layer norm is Apex's CUDA kernel",
    "--no-masked-softmax-fusion": "the fused masked softmax is a CUDA kernel",
    "--no-bias-dropout-fusion": "the fused bias-dropout-add is a CUDA kernel",
    "--no-rope-fusion": "the fused RoPE is a Transformer Engine kernel",
    "--no-bias-gelu-fusion": "the bias-GeLU fusion is a compiled kernel (and refuses MoE's per-token scales)",
    "--no-bias-swiglu-fusion": "the bias-SwiGLU fusion is a compiled kernel",
}
# flags that only pick a CUDA kernel, RNG or memory placement for the same math: dropped, with the reason
SAME_MATH = {
    "--moe-grouped-gemm": ("the grouped GEMM is a Transformer Engine/CUTLASS kernel; Megatron's sequential "
                           "experts instead"),
    "--moe-permute-fusion": "the fused permutation is a Transformer Engine kernel",
    "--cross-entropy-loss-fusion": "the fused cross entropy is a CUDA kernel",
    "--use-flash-attn": "flash attention is a CUDA kernel; the attention is the unfused one, the same math",
    "--te-rng-tracker": ("Transformer Engine's RNG tracker holds CUDA generator states; Megatron's own tracker "
                         "(the runs draw no dropout, and initialise the weights on the CPU)"),
    "--fine-grained-activation-offloading": ("activation offloading moves activations to host memory, where a "
                                             "CPU run's are already"),
    "--offload-modules": "the modules of the activation offloading, dropped with it",
    "--defer-embedding-wgrad-compute": ("Megatron defers the embedding's weight gradient only through "
                                        "gradient-accumulation fusion, a CUDA extension; the same math"),
    "--overlap-moe-expert-parallel-comm": ("the expert-parallel all-to-all overlaps another micro-batch's "
                                           "computation on CUDA streams, in half precision only; the same math"),
    "--delay-wgrad-compute": ("the weight gradients wait to overlap the all-to-all above, dropped with it; "
                              "the same math"),
    "--ep-overlap-early-attn-memory-release": "a memory saving of the all-to-all overlap above, dropped with it",
}
DISPATCHER = "--moe-token-dispatcher-type"
# a learning-rate schedule in samples -> the same in iterations (the runs count --train-iters)
SAMPLE_SCHEDULES = {"--lr-decay-samples": "--lr-decay-iters", "--lr-warmup-samples": "--lr-warmup-iters",
                    "--lr-wsd-decay-samples": "--lr-wsd-decay-iters"}
# flags that change the global batch as training goes: the runs compare steps of one batch size
BATCH_SCHEDULES = ("--step-batch-size-schedule", "--rampup-batch-size")
# flags whose runs cannot be compared, and why (refused when given a value other than "0")
NOT_COMPARABLE = {
    "--fim-data": ("fill-in-the-middle rearranges the documents of real data files, and the runs train on mock "
                   "data (Megatron's FIM dataset refuses it)"),
    "--error-injection-rate": ("Megatron's rerun machinery then injects errors into the results on purpose "
                               "(a test of its result validation), so the runs would compare injected errors"),
}
DATA_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
              "--data-args-path", "--per-split-data-args-path", "--tokenizer-model", "--vocab-file",
              "--merge-file", "--data-cache-path", "--train-samples", "--save", "--load",
              "--tensorboard-dir", "--wandb-project", "--wandb-exp-name", "--save-interval",
              "--exit-interval", "--exit-duration-in-mins")
REPLACED = {"--transformer-impl": "local", "--distributed-backend": "gloo", "--tokenizer-type": "NullTokenizer",
            "--hidden-dropout": "0.0", "--attention-dropout": "0.0", "--attention-backend": "auto",
            "--cross-entropy-fusion-impl": "native"}
REASONS = {
    "--transformer-impl": ("Megatron's local layers (give --transformer-impl transformer_engine to run "
                           "Transformer Engine's own layers on shardcheck's CPU kernels)"),
    "--distributed-backend": "NCCL needs GPUs: Gloo",
    "--tokenizer-type": "mock data needs no tokenizer files",
    "--hidden-dropout": "dropout masks come from each layout's own RNG streams, so layouts cannot agree",
    "--attention-dropout": "dropout masks come from each layout's own RNG streams, so layouts cannot agree",
    "--attention-backend": ("the fused and flash backends are CUDA kernels, the unfused one is Transformer "
                            "Engine's: auto picks what runs here (Megatron's local attention, or TE's unfused one "
                            "in float32)"),
    "--cross-entropy-fusion-impl": "the fused cross entropy is a Transformer Engine kernel",
}
DEFAULT_VOCAB = 1024
DEFAULT_LR = "1e-4"  # for a config without one (an inference test's): Megatron has no default
PER_TOKEN_LOSS = "--calculate-per-token-loss"
WHOLE_BATCH, SAME_MICRO_BATCHES = "whole-batch", "same-micro-batches"
# Loss terms Megatron computes per micro-batch even with per-token loss: the split changes them.
PER_MICRO_BATCH_LOSSES = ("--moe-aux-loss-coeff", "--moe-z-loss-coeff")
REFERENCES = (WHOLE_BATCH, SAME_MICRO_BATCHES)
"""The one-rank reference's batching: the whole global batch in one micro-batch, or the
parallel run's micro-batches accumulated (``--reference``)."""


class TrainInputError(Exception):
    """The user's flags cannot run here; the message is one line that says why."""


@functools.cache
def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's own argument parser (every flag ``pretrain`` accepts)."""
    from shardcheck.megatron.train.cpu import patch_typing_override

    patch_typing_override()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed", ...
        try:
            from megatron.training.arguments import add_megatron_arguments
        except ImportError as why:  # megatron.training of another release than megatron.core
            raise TrainInputError(f"megatron.training does not import with this megatron-core "
                                  f"({why}); shardcheck train needs both from one release, 0.19 "
                                  "or later, or a Megatron-LM checkout (--megatron)") from None

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False, add_help=False))


class Flags:
    """A Megatron command line as ordered flags with their values, edited by flag name."""

    def __init__(self, tokens: Sequence[str], parser: argparse.ArgumentParser) -> None:
        self.items: list[tuple[str, list[str]]] = []
        self.parser = parser
        i = 0
        tokens = list(tokens)
        while i < len(tokens):
            flag = tokens[i]
            if not flag.startswith("--"):
                raise TrainInputError(f"unexpected argument {flag!r}: Megatron flags start with --")
            flag, eq, inline = flag.partition("=")
            action = parser._option_string_actions.get(flag)
            if action is None:
                raise TrainInputError(f"unknown Megatron flag {flag}")
            i += 1
            values = [inline] if eq else []
            if not eq and action.nargs != 0:
                while i < len(tokens) and not (tokens[i].startswith("--") and tokens[i][2:3].isalpha()):
                    values.append(tokens[i])
                    i += 1
                    if action.nargs in (None, 1):
                        break
            self.items.append((flag, values))

    def copy(self) -> Flags:
        new = Flags([], self.parser)
        new.items = [(f, list(v)) for f, v in self.items]
        return new

    def has(self, flag: str) -> bool:
        return any(f == flag for f, _ in self.items)

    def get(self, flag: str) -> str | None:
        for f, values in self.items:
            if f == flag:
                return values[0] if values else ""
        return None

    def value(self, flag: str) -> Any:
        """The flag's parsed value, Megatron's default when it is absent."""
        action = self.parser._option_string_actions[flag]
        namespace = self.parser.parse_known_args(self.tokens())[0]
        return getattr(namespace, action.dest)

    def set(self, flag: str, *values: str) -> None:
        self.drop(flag)
        self.items.append((flag, list(values)))

    def drop(self, flag: str) -> bool:
        before = len(self.items)
        self.items = [(f, v) for f, v in self.items if f != flag]
        return len(self.items) != before

    def tokens(self) -> list[str]:
        return [token for flag, values in self.items for token in (flag, *values)]


@dataclass
class RunPlan:
    """The arguments of the N-rank run and its one-rank reference, and what was changed."""

    world: int
    parallel: list[str]
    reference: list[str]
    changes: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)
    same_init: bool = False  # the N-rank run loads the one-rank run's initial weights
    reference_kind: str = SAME_MICRO_BATCHES  # one of REFERENCES
    reference_lines: list[str] = field(default_factory=list)  # which reference, and its caveat
    precision: str = "fp32"  # what both runs train in: fp32, or the bf16/fp16 TE's CP attention needs

    @property
    def steps(self) -> int:
        return int(self.parallel[self.parallel.index("--train-iters") + 1])


def plan_runs(user_args: Sequence[str], nproc: int, steps: int | None, cpu: bool = True,
              own_entry: bool = False, reference: str | None = None) -> RunPlan:
    """The N-rank and one-rank arguments for ``user_args``, and one line per change.

    ``own_entry``: the runs use shardcheck's GPT entry point, which refuses :data:`NOT_BUILT`
    (the command line's default; without it, the flags are the entry script's to build).
    ``reference``: one of :data:`REFERENCES`; by default the whole batch where the loss is
    per token (``--calculate-per-token-loss``: independent of the split) and no MoE auxiliary
    or z-loss is weighted in (Megatron computes those per micro-batch), else the same
    micro-batches (Megatron's loss is then a mean of micro-batch means).
    """
    flags = Flags(user_args, megatron_parser())
    changes: list[str] = []
    sizes = {name: int(flags.value(name) or 1) for name in PARALLEL_SIZES}
    tp, pp, cp = (sizes[n] for n in PARALLEL_SIZES[:3])
    te = _transformer_engine(flags, changes, cp) if cpu else flags.value("--transformer-impl") == TE
    if flags.has(HETEROGENEOUS_JSON) and not flags.has(HETEROGENEOUS_PATH):
        raise TrainInputError(f"{HETEROGENEOUS_JSON} without {HETEROGENEOUS_PATH}: megatron-core builds heterogeneous "
                              "layers only when the path is given (Megatron-LM's pretrain_gpt.py would train a "
                              f"plain GPT); give {HETEROGENEOUS_PATH}")
    if own_entry:
        _refuse_not_built(flags, te)
    if nproc % (tp * pp * cp):
        raise TrainInputError(f"-n {nproc} is not a multiple of tp*pp*cp = {tp * pp * cp}")
    dp = nproc // (tp * pp * cp)
    if cpu:
        _cpu_flags(flags, changes, te, keep_half=te and cp > 1)
    _common_flags(flags, changes, steps, dp)
    per_token = flags.has(PER_TOKEN_LOSS)
    split_terms = _per_micro_batch_losses(flags)
    kind = reference or (WHOLE_BATCH if per_token and not split_terms else SAME_MICRO_BATCHES)
    if kind not in REFERENCES:
        raise TrainInputError(f"unknown reference {kind!r}: one of {', '.join(REFERENCES)}")
    one_rank = _one_rank(flags, tp, changes)
    lines = _batch_reference(one_rank, kind, per_token, asked=reference is not None)
    if split_terms:
        lines.append(f"{', '.join(split_terms)}: Megatron computes {'these losses' if len(split_terms) > 1 else 'this loss'} "
                     "per micro-batch, so the split changes it"
                     + (": a difference may be that, not a bug" if kind == WHOLE_BATCH else ""))
    if flags.get("--num-experts") is not None and "sinkhorn" in flags.value("--moe-router-load-balancing-type"):
        lines.append("--moe-router-load-balancing-type sinkhorn: Megatron balances the routing over the tokens one "
                     "rank holds (its micro-batch, its sequence slice under sequence parallelism), so the split "
                     "changes which expert a token goes to: a difference may be that, not a bug")
    reasons = [why for why, holds in (
        ("Megatron seeds each pipeline stage and expert rank apart",
         pp > 1 or (flags.get("--num-experts") is not None and sizes["--expert-model-parallel-size"] > 1)),
        ("a gated delta net draws its A_log and conv1d weights per tensor-parallel shard",
         tp > 1 and (flags.get("--experimental-attention-variant") == "gated_delta_net" or "G" in _pattern(flags))),
        ("a Mamba mixer draws its A_log, dt_bias and conv1d weights per tensor-parallel shard",
         tp > 1 and "M" in _pattern(flags))) if holds]
    same_init = bool(reasons)
    if same_init:
        changes.append("the parallel run starts from the one-rank run's initial weights (Megatron's own "
                       f"torch_dist save and load): {'; '.join(reasons)}")
        if (checkpoints := flags.value("--ckpt-format")) != "torch_dist":
            changes.append(f"--ckpt-format {checkpoints} -> torch_dist: only Megatron's torch_dist checkpoints load "
                           "into another layout")
            for run in (flags, one_rank):
                run.set("--ckpt-format", "torch_dist")
        for flag in NOT_WITH_TORCH_DIST:
            if flags.drop(flag):
                changes.append(f"{flag} dropped: Megatron refuses it with torch_dist checkpoints, from which the "
                               "parallel run loads its initial weights; it overlaps communication only")
    precision = (_half_precision(flags) or "--fp32")[2:]
    return RunPlan(nproc, flags.tokens(), one_rank.tokens(), changes, {**sizes, "dp": dp}, same_init,
                   kind, lines, precision)


def _transformer_engine(flags: Flags, changes: list[str], cp: int) -> bool:
    """Whether the CPU runs keep ``--transformer-impl transformer_engine`` (given explicitly,
    TE's CPU layer installed); refuses what TE's path cannot run on a CPU."""
    if not flags.has("--transformer-impl") or flags.value("--transformer-impl") != TE:
        return False  # not given (Megatron's default), or local as the last one given says
    from shardcheck.megatron.cpu.te import te_dir

    if not (te_dir() / "transformer_engine").is_dir():
        changes.append(f"--transformer-impl transformer_engine -> local: Transformer Engine's CPU layer is not "
                       f"installed in {te_dir()} (make installs it): Megatron's local layers")
        flags.set("--transformer-impl", "local")
        return False
    if cp > 1 and not _half_precision(flags):
        te_only = next((flag for flag in TE_ONLY if flags.has(flag)), None)
        raise TrainInputError(
            f"--context-parallel-size {cp} with --transformer-impl transformer_engine in float32: Transformer "
            "Engine's context-parallel attention runs in bf16 or fp16 only (its fused and flash backends take "
            "nothing else, its unfused one has no context parallelism), on a GPU as here; give --bf16"
            + (f" ({te_only} builds only with Transformer Engine)" if te_only else
               ", or --transformer-impl local for shardcheck's CP attention stand-in in float32"))
    if cp > 1:
        half = _half_precision(flags)
        changes.append(f"{half} kept: Transformer Engine's context-parallel attention runs in bf16 or fp16 only; "
                       f"both runs train in {half[2:]} and are compared at its tolerance")
    changes.append("--transformer-impl transformer_engine kept: Transformer Engine's own layers, on shardcheck's "
                   "CPU kernels (its fused optimizers are CUDA kernels: Megatron's torch optimizer, as without TE)")
    return True


def _half_precision(flags: Flags) -> str | None:
    """The half-precision flag the user gave (``--bf16`` or ``--fp16``), else None."""
    return next((flag for flag in ("--bf16", "--fp16") if flags.has(flag)), None)


def _refuse_not_built(flags: Flags, te: bool) -> None:
    if not te:
        for flag, why in TE_ONLY.items():
            if flags.has(flag):
                raise TrainInputError(f"{flag} with Megatron's local layers: {why}; give --transformer-impl "
                                      "transformer_engine")
    other = {**dict.fromkeys(_vision_flags(flags.parser), "vision and multimodal models (LLaVA, ViT)"), **OTHER_MODELS}
    for flag, what in other.items():
        if flags.has(flag):
            raise TrainInputError(f"{flag}: a flag of Megatron's {what}, which shardcheck's GPT entry point does "
                                  "not build; give their entry script with --entry")
    built = {flag: what for flag, what in NOT_BUILT.items() if flags.has(flag)}
    if _names_the_hybrid_stack_spec(flags):
        del built["--spec"]  # the spec shardcheck's entry point builds for a hybrid pattern
    if flags.has("--mtp-num-layers") and flags.has("--pipeline-model-parallel-layout"):
        built["--mtp-num-layers with --pipeline-model-parallel-layout"] = "MTP layers a pipeline layout places"
    script = "pretrain_hybrid.py" if _pattern(flags) else "pretrain_gpt.py"
    for flag, what in built.items():
        raise TrainInputError(f"{flag}: shardcheck's entry point does not build {what} yet; run "
                              f"Megatron-LM's own {script} with --entry PATH/{script}")


def _vision_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The flags of Megatron's ``vision`` argument group (image sizes, patches, DINO, ...)."""
    return [action.option_strings[0] for group in parser._action_groups if group.title == "vision"
            for action in group._group_actions]


def _pattern(flags: Flags) -> str:
    """The hybrid layer pattern the flags give (MTP and pipeline parts included), or ""."""
    return next((flags.get(flag) or "" for flag in HYBRID_PATTERNS if flags.has(flag)), "")


def _names_the_hybrid_stack_spec(flags: Flags) -> bool:
    """Whether ``--spec`` names megatron-core's hybrid stack spec, with a hybrid pattern given."""
    spec = flags.value("--spec")
    return (spec is not None and any(flags.has(flag) for flag in HYBRID_PATTERNS)
            and tuple(spec) in HYBRID_SPECS)


def _cpu_flags(flags: Flags, changes: list[str], te: bool, keep_half: bool) -> None:
    for flag, why in IMPOSSIBLE.items():
        if flags.has(flag):
            raise TrainInputError(f"{flag} cannot run on a CPU: {why}")
    sparse = ["--experimental-attention-variant dsa"] if flags.get("--experimental-attention-variant") == "dsa" else []
    sparse += [f"{flag} with D layers" for flag in HYBRID_PATTERNS if "D" in (flags.get(flag) or "")]
    if sparse:  # DeepSeek sparse attention, as a variant or a hybrid pattern's D layers
        raise TrainInputError(f"{sparse[0]} cannot run on a CPU: its indexer's Hadamard rotation is the "
                              "fast_hadamard_transform CUDA kernel, on bf16 only (megatron-core asserts both), and "
                              "the runs compare in float32")
    for flag, value in REPLACED.items():
        old = flags.get(flag)
        if te and (flag == "--transformer-impl" or (flag == "--attention-backend" and old in TE_ATTENTION_BACKENDS)):
            continue  # Transformer Engine's own layers, and its attention backends with CPU kernels
        if old == value:
            continue
        default = flags.value(flag)
        if str(default) in (value, f"AttnBackend.{value}") or (flag.endswith("dropout") and float(default) == 0):
            continue
        flags.set(flag, value)
        changes.append(f"{flag} {old if old is not None else f'{default} (default)'} -> {value}: {REASONS[flag]}")
    for flag, why in UNFUSED.items():
        if not flags.has(flag):
            flags.set(flag)
            changes.append(f"{flag} added: {why}")
    for flag, why in SAME_MATH.items():
        if flags.drop(flag):
            changes.append(f"{flag} dropped: {why}")
    if flags.get(DISPATCHER) == "flex":
        flags.set(DISPATCHER, "alltoall")
        flags.drop("--moe-flex-dispatcher-backend")
        changes.append(f"{DISPATCHER} flex -> alltoall: the flex dispatcher's backends (DeepEP, HybridEP) are CUDA "
                       "kernels; Megatron's all-to-all dispatcher routes the same tokens to the same experts")
    _recompute_without(flags, changes, "moe_act", "megatron-core recomputes the expert activation only with "
                       "the grouped GEMM, dropped on a CPU; recomputing is the same math")
    for flag in ("--bf16", "--fp16"):
        if not keep_half and flags.drop(flag):
            changes.append(f"{flag} dropped: the runs are compared in float32 (CPU half-precision "
                           "matmuls round differently from a GPU's)")


def _recompute_without(flags: Flags, changes: list[str], module: str, why: str) -> None:
    """Take ``module`` out of ``--recompute-modules`` (the flag left out when none is left)."""
    modules = next((values for flag, values in flags.items if flag == "--recompute-modules"), [])
    if module not in modules:
        return
    kept = [m for m in modules if m != module]
    if kept:
        flags.set("--recompute-modules", *kept)
    else:
        flags.drop("--recompute-modules")
    changes.append(f"--recompute-modules {' '.join(modules)} -> {' '.join(kept) or 'left out'}: {why}")


def _common_flags(flags: Flags, changes: list[str], steps: int | None, dp: int) -> None:
    if flags.has("--use-checkpoint-args"):  # an inference test's: its model is the checkpoint's
        raise TrainInputError("--use-checkpoint-args: the model's shape comes from the checkpoint of --load, "
                              "and the runs train a new model on mock data; give the model's flags instead")
    optimizer = flags.value("--optimizer")
    if optimizer not in ("adam", "sgd") and not _have_emerging_optimizers():
        raise TrainInputError(f"--optimizer {optimizer}: megatron-core builds it from the emerging-optimizers "
                              "package, which is not installed (pip install emerging-optimizers)")
    for flag, why in NOT_COMPARABLE.items():
        if flags.has(flag) and flags.get(flag) != "0":
            raise TrainInputError(f"{flag}: {why}")
    for flag in BATCH_SCHEDULES:
        if flags.has(flag):
            raise TrainInputError(f"{flag}: the global batch changes as training goes, and the runs compare "
                                  "steps of one global batch; give --global-batch-size instead")
    for flag in DATA_FLAGS:
        if flags.drop(flag):
            changes.append(f"{flag} dropped: the runs train on mock data, from scratch, saving nothing")
    flags.set("--mock-data")
    if flags.get("--vocab-size") is None:
        flags.set("--vocab-size", str(DEFAULT_VOCAB))
        changes.append(f"--vocab-size {DEFAULT_VOCAB} added: the mock tokenizer needs a vocabulary size")
    if flags.value("--lr") is None:
        flags.set("--lr", DEFAULT_LR)
        changes.append(f"--lr {DEFAULT_LR} added: Megatron has no default learning rate, and its optimizer needs one")
    if steps is not None or flags.get("--train-iters") is None:
        flags.set("--train-iters", str(steps or 3))
    if not flags.has("--use-cpu-initialization"):
        flags.set("--use-cpu-initialization")
        changes.append("--use-cpu-initialization added: every layout starts from the same full weights")
    if flags.value("--micro-batch-size") is None:
        raise TrainInputError("give --micro-batch-size: Megatron has no default for it")
    if flags.get("--global-batch-size") is None:
        micro = int(flags.value("--micro-batch-size"))
        flags.set("--global-batch-size", str(micro * dp))
        changes.append(f"--global-batch-size {micro * dp} added: the one-rank run takes the same global batch")
    global_batch = int(flags.value("--global-batch-size"))
    for flag, iters in SAMPLE_SCHEDULES.items():
        samples = flags.get(flag)
        if flags.drop(flag) and not flags.has(iters):
            flags.set(iters, str(-(-int(samples) // global_batch)))
            changes.append(f"{flag} {samples} -> {iters} {flags.get(iters)}: the runs count iterations, "
                           f"of {global_batch} samples each")
    for flag, values in (("--no-create-attention-mask-in-dataloader", []), ("--log-interval", ["1"]), ("--log-num-zeros-in-grad", []),
                         ("--eval-iters", ["0"]), ("--eval-interval", ["1000000"])):
        flags.set(flag, *values)


def _have_emerging_optimizers() -> bool:
    """Whether megatron-core found the emerging-optimizers package (Muon, Lion, SOAP, ...)."""
    from megatron.core.optimizer import HAVE_EMERGING_OPTIMIZERS

    return bool(HAVE_EMERGING_OPTIMIZERS)


def _one_rank(flags: Flags, tp: int, changes: list[str]) -> Flags:
    reference = flags.copy()
    for flag in PARALLEL_SIZES:
        reference.drop(flag)
    for flag in (*PIPELINE_SPLITS, *CONTEXT_PARALLEL_SPLITS, "--sequence-parallel"):
        reference.drop(flag)
    for flag, why in PARALLEL_ONLY.items():
        if reference.drop(flag):
            changes.append(f"one-rank run: {flag} dropped: {why}")
    for flag in HYBRID_PATTERNS:
        pattern = reference.get(flag)
        if pattern and "|" in pattern:  # its pipeline stages would be virtual ones on one rank
            reference.set(flag, pattern.replace("|", ""))
            changes.append(f"one-rank run: {flag} {pattern.replace('|', '')}, without the pipeline stages "
                           "(|) that split it")
    divisible = int(flags.value("--make-vocab-size-divisible-by"))
    vocab = int(flags.value("--vocab-size"))
    if _padded(vocab, divisible * tp) != _padded(vocab, divisible):
        reference.set("--make-vocab-size-divisible-by", str(divisible * tp))
        changes.append(f"one-rank run: --make-vocab-size-divisible-by {divisible * tp}, so that its "
                       f"vocabulary pads to the same size as under tp{tp}")
    return reference


def _per_micro_batch_losses(flags: Flags) -> list[str]:
    """The flags of :data:`PER_MICRO_BATCH_LOSSES` set to a non-zero weight."""
    def weights(value: Any) -> list[float]:
        return [float(v) for v in (value if isinstance(value, list) else [value]) if v is not None]

    return [flag for flag in PER_MICRO_BATCH_LOSSES if any(weights(flags.value(flag)))]


def _batch_reference(reference: Flags, kind: str, per_token: bool, asked: bool) -> list[str]:
    """Set the one-rank run's micro-batch size for ``kind``; the lines that say which reference it is."""
    global_batch = int(reference.value("--global-batch-size"))
    micro = int(reference.value("--micro-batch-size"))
    if per_token:
        why = (f"{PER_TOKEN_LOSS}: the loss is summed over tokens and divided by the global token count"
               + (", so the split does not matter" if kind == WHOLE_BATCH else ""))
    else:
        why = f"no {PER_TOKEN_LOSS}: Megatron's loss is a mean of micro-batch means"
    why = f"--reference {kind}" if asked else why
    if kind == SAME_MICRO_BATCHES:
        return [f"one rank, the global batch of {global_batch} in the same {global_batch // micro} "
                f"micro-batches of {micro} ({why})"]
    reference.set("--micro-batch-size", str(global_batch))
    lines = [f"one rank, the whole global batch of {global_batch} in one micro-batch ({why})"]
    if not per_token:
        lines.append(f"without {PER_TOKEN_LOSS} Megatron's loss is a mean of micro-batch means, so it "
                     "depends on the split: a difference may be that definition, not a bug")
    return lines


def _padded(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple
