"""A Megatron functional test's ``model_config.yaml`` as the flags of a small CPU training job.

MODEL_ARGS become flags (``true`` a bare flag, ``false`` left out). What sets the model's size
shrinks: layers, hidden and FFN sizes, heads and query groups, sequence, vocabulary, experts,
micro and global batch, and the parallel sizes (to at most 8 ranks). Every flag that picks a
code path (normalisation, SwiGLU, RoPE, GQA, sequence parallelism, the dispatcher, loss
masking, ...) is kept. :func:`flags_from_model_config` returns the flags, the number of ranks
and one line per value it changed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from shardcheck.golden.config import load_model_config
from shardcheck.golden.io import GoldenInputError
from shardcheck.megatron.train.args import (
    BATCH_SCHEDULES,
    HYBRID_PATTERNS,
    TrainInputError,
    megatron_parser,
)

MAX_RANKS = 8
HIDDEN = 64
SEQUENCE = 64
# flags that only concern a cluster run: checkpoints, async saving, profiling, data on disk
CLUSTER_ONLY = ("--async-save", "--use-persistent-ckpt-worker", "--ckpt-assume-constant-structure",
                "--dist-ckpt-strictness", "--ckpt-fully-parallel-load", "--ckpt-fully-parallel-save",
                "--log-memory-to-tensorboard", "--log-timers-to-tensorboard",
                "--log-validation-ppl-to-tensorboard", "--profile", "--use-pytorch-profiler",
                "--manual-gc", "--manual-gc-interval")


# Megatron-LM's MIMO and hybrid scripts pick their model with --model-provider; shardcheck's
# entry point builds these (a hybrid or Mamba model from its layer pattern).
MODEL_PROVIDER = "--model-provider"
HIERARCHICAL_CP = "--hierarchical-context-parallel-sizes"
GROUP_SIZE = "--microbatch-group-size-per-virtual-pipeline-stage"
OPTIMIZER_INSTANCES = "--num-distributed-optimizer-instances"
# a pipeline split that counts the embedding or the loss as a layer of the first or last stage
SPLIT_COUNTED = {"--account-for-embedding-in-pipeline-split": "the embedding",
                 "--account-for-loss-in-pipeline-split": "the loss"}
BUILT_PROVIDERS = frozenset({"gpt", "hybrid", "mamba"})
# Megatron's functional tests sit in a folder per model; these folders' models have entry scripts
# of their own, whose models shardcheck's GPT entry point does not build
OTHER_FAMILIES = {"bert": ("BERT", "pretrain_bert.py"), "t5": ("T5", "pretrain_t5.py"),
                  "multimodal-llava": ("LLaVA", "pretrain_vlm.py")}


@dataclass
class ShrunkConfig:
    """The CPU job of a model config: its flags, its ranks, and the mapping applied."""

    flags: list[str]
    nproc: int
    mapping: list[str] = field(default_factory=list)


def flags_from_model_config(path: Path, nproc: int | None = None, own_entry: bool = True) -> ShrunkConfig:
    """The flags of a small CPU run of the functional test at ``path``; ``own_entry``: for
    shardcheck's GPT entry point, which refuses the tests of Megatron's other model families."""
    family = OTHER_FAMILIES.get(path.parent.parent.name)
    if own_entry and family is not None:
        raise TrainInputError(f"{path}: a functional test of Megatron's {family[0]} models (its folder "
                              f"{path.parent.parent.name}/), which Megatron-LM trains with {family[1]}; "
                              "shardcheck's GPT entry point does not build them: give that script with --entry")
    try:
        config = load_model_config(path)
    except GoldenInputError as exc:
        raise TrainInputError(str(exc)) from exc
    if not config.model_args:
        raise TrainInputError(f"{path}: no MODEL_ARGS in it")
    args = dict(config.model_args)
    mapping: list[str] = []
    known = megatron_parser()._option_string_actions
    provider = args.get(MODEL_PROVIDER, "gpt")
    if MODEL_PROVIDER not in known and provider not in BUILT_PROVIDERS:
        raise TrainInputError(f"{MODEL_PROVIDER} {provider}: the config's entry script builds that model (a flag of "
                              "its script, not of megatron-core), which shardcheck's GPT entry point does not "
                              "build; give their entry script with --entry")
    for flag in list(args):
        if flag not in known:
            mapping.append(f"{flag} left out: not a flag of this megatron-core")
            del args[flag]
        elif flag in CLUSTER_ONLY or "${" in args[flag]:
            del args[flag]
    if not args:
        raise TrainInputError(f"{path}: none of its MODEL_ARGS is a flag of this megatron-core "
                              f"(e.g. {next(iter(config.model_args))}: a NeMo recipe's, not Megatron-LM's)")
    sizes = _shrink_parallel(args, mapping)
    world = nproc or min(MAX_RANKS, _prod(sizes) * 2)
    if world % _prod(sizes):
        raise TrainInputError(f"-n {world} is not a multiple of tp*pp*cp = {_prod(sizes)}")
    _shrink_model(args, sizes, world // _prod(sizes), mapping)
    flags = []
    for flag, value in args.items():
        if value == "false":
            continue
        if value.startswith("[") and value.endswith("]"):  # a list, as --spec's is written
            value = value[1:-1]
        one_value = known[flag].nargs in (None, 1)  # e.g. a schedule "0:384 200B:768" is one value
        flags += [flag] if value == "true" else [flag, *([value] if one_value else value.split())]
    return ShrunkConfig(flags, world, mapping)


def _prod(sizes: dict[str, int]) -> int:
    return sizes["tp"] * sizes["pp"] * sizes["cp"]


def _int(args: dict[str, str], flag: str, default: int) -> int:
    try:
        return int(float(args.get(flag, default)))
    except ValueError:
        return default


def _set(args: dict[str, str], mapping: list[str], flag: str, value: int | str, why: str = "") -> None:
    old = args.get(flag)
    if old is not None and str(old) == str(value):
        return
    args[flag] = str(value)
    if old is not None:
        mapping.append(f"{flag} {old} -> {value}{': ' + why if why else ''}")


def _shrink_parallel(args: dict[str, str], mapping: list[str]) -> dict[str, int]:
    sizes = {"tp": _int(args, "--tensor-model-parallel-size", 1),
             "pp": _int(args, "--pipeline-model-parallel-size", 1),
             "cp": _int(args, "--context-parallel-size", 1)}
    levels = [int(v) for v in re.findall(r"\d+", args.get(HIERARCHICAL_CP, ""))]  # "2 2" or "[2, 2]"
    while _prod(sizes) > MAX_RANKS // 2 and max(sizes.values()) > 1:
        # hierarchical context parallelism (a2a+p2p) keeps its levels while another size can go
        others = [k for k in sizes if sizes[k] > 1 and not (k == "cp" and levels)]
        largest = max(others or sizes, key=lambda k: sizes[k])
        sizes[largest] //= 2
    flags = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
             "cp": "--context-parallel-size"}
    for name, flag in flags.items():
        if flag in args:
            _set(args, mapping, flag, sizes[name], f"at most {MAX_RANKS} ranks, with room for dp2")
    if args.get("--use-tp-pp-dp-mapping") == "true" and "--expert-tensor-parallel-size" in args:
        # that rank order needs as many data-parallel ranks for experts as for attention
        expert = max(1, sizes["tp"] * sizes["cp"] // _int(args, "--expert-model-parallel-size", 1))
        _set(args, mapping, "--expert-tensor-parallel-size", expert, "with --use-tp-pp-dp-mapping, expert "
             "tp x ep must stay tp x cp")
    while levels and math.prod(levels) > sizes["cp"]:
        levels[levels.index(max(levels))] //= 2
    if levels:
        _set(args, mapping, HIERARCHICAL_CP, " ".join(map(str, levels)), "their product is the context-parallel size")
    return sizes


def _shrink_model(args: dict[str, str], sizes: dict[str, int], dp: int, mapping: list[str]) -> None:
    tp, pp, cp = sizes["tp"], sizes["pp"], sizes["cp"]
    vpp = _int(args, "--num-layers-per-virtual-pipeline-stage", 0)
    stages = pp * (2 if vpp or "--num-virtual-stages-per-pipeline-rank" in args else 1)
    if vpp:
        _set(args, mapping, "--num-layers-per-virtual-pipeline-stage", 1)
    if "--num-virtual-stages-per-pipeline-rank" in args:
        _set(args, mapping, "--num-virtual-stages-per-pipeline-rank", 2)
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--pipeline-model-parallel-layout"):
        if args.pop(flag, None) is not None:
            mapping.append(f"{flag} left out: the layers split evenly over the shrunk pipeline")
    pattern = next((flag for flag in HYBRID_PATTERNS if flag in args), None)
    counted = [flag for flag in SPLIT_COUNTED if args.get(flag) == "true"]
    if pattern is None and counted:  # (layers + the embedding and/or loss) split evenly over the stages
        _set(args, mapping, "--num-layers", -len(counted) % stages or stages,
             f"one layer per pipeline stage, {' and '.join(SPLIT_COUNTED[f] for f in counted)} counted as layers")
    elif pattern is None:
        _set(args, mapping, "--num-layers", max(2, stages), "at least one layer per pipeline stage")
    else:
        _set(args, mapping, pattern, shrink_pattern(args[pattern]), "each kind of layer once per pipeline "
             "segment, in its order")
        if "--num-layers" in args:
            _set(args, mapping, "--num-layers", len(args[pattern].split("/")[0].replace("|", "")),
                 "the shrunk pattern's layers")
        if "M" in args[pattern]:
            _shrink_mamba(args, tp, mapping)
    heads = max(4, tp)
    _set(args, mapping, "--hidden-size", HIDDEN)
    _set(args, mapping, "--num-attention-heads", heads)
    if "--num-query-groups" in args:
        groups_were_fewer = _int(args, "--num-query-groups", heads) < _int(args, "--num-attention-heads", heads)
        _set(args, mapping, "--num-query-groups", max(tp, heads // 2) if groups_were_fewer else heads)
    if "--kv-channels" in args:
        _set(args, mapping, "--kv-channels", HIDDEN // heads)
    if "--ffn-hidden-size" in args:
        _set(args, mapping, "--ffn-hidden-size", 2 * HIDDEN)
    for flag in ("--seq-length", "--max-position-embeddings"):
        _set(args, mapping, flag, SEQUENCE)
    _set(args, mapping, "--vocab-size", 1024, "mock data")
    _set(args, mapping, "--micro-batch-size", 1)
    for flag in BATCH_SCHEDULES:
        if args.pop(flag, None) is not None:
            mapping.append(f"{flag} left out: one global batch size")
    if stages > pp:  # the interleaved schedule wants at least one micro-batch per pipeline rank
        _set(args, mapping, "--global-batch-size", max(2, pp) * dp,
             f"{max(2, pp)} micro-batches per data-parallel rank, at least one per pipeline rank")
        if GROUP_SIZE in args:  # Megatron wants it between the pipeline size and the micro-batches
            _set(args, mapping, GROUP_SIZE, max(2, pp), "the micro-batches per data-parallel rank")
    else:
        _set(args, mapping, "--global-batch-size", 2 * dp, "two micro-batches per data-parallel rank")
    _shrink_experts(args, dp * cp, mapping)
    _shrink_optimizer_instances(args, sizes, dp, mapping)
    if "--eval-iters" in args:
        _set(args, mapping, "--eval-iters", 0, "no evaluation")


def _shrink_optimizer_instances(args: dict[str, str], sizes: dict[str, int], dp: int, mapping: list[str]) -> None:
    """The distributed optimizer's instances to a count that divides both data-parallel sizes
    (Megatron asserts it for the dense and the expert ranks) of the shrunk layout."""
    instances = _int(args, OPTIMIZER_INSTANCES, 1)
    if instances <= 1:
        return
    tp, cp = sizes["tp"], sizes["cp"]
    expert_width = _int(args, "--expert-tensor-parallel-size", tp) * _int(args, "--expert-model-parallel-size", 1)
    expert_dp = max(1, tp * cp * dp // expert_width)
    _set(args, mapping, OPTIMIZER_INSTANCES, math.gcd(instances, dp * cp, expert_dp),
         "it must divide the data-parallel sizes, dense and expert")


def shrink_pattern(pattern: str) -> str:
    """A hybrid layer pattern with each pipeline segment (``|``) and MTP depth (``/``) cut to the
    first layer of each kind it holds, in their order: ``M-M-M*-|M*-M-/MM`` -> ``M-*|M*-/M``."""
    def once(part: str) -> str:
        return "".join(dict.fromkeys(part))

    return "/".join("|".join(once(segment) for segment in part.split("|")) for part in pattern.split("/"))


def _shrink_mamba(args: dict[str, str], tp: int, mapping: list[str]) -> None:
    """Mamba's head size, groups and state to the shrunk hidden size: 8 heads of 16 (expand 2),
    in groups that tensor parallelism can split, a state of 16."""
    for flag, value in (("--mamba-head-dim", HIDDEN // 4), ("--mamba-num-groups", max(2, tp)),
                        ("--mamba-state-dim", 16)):
        if flag not in args:
            args[flag] = str(value)
            mapping.append(f"{flag} {value} added: Megatron's default is for a hidden size of thousands")
        else:
            _set(args, mapping, flag, value)
    if args.pop("--mamba-num-heads", None) is not None:
        mapping.append("--mamba-num-heads left out: the head size sets the heads")


def _shrink_experts(args: dict[str, str], expert_room: int, mapping: list[str]) -> None:
    if "--num-experts" not in args:
        return
    ep = _int(args, "--expert-model-parallel-size", 1)
    while ep > 1 and expert_room % ep:
        ep //= 2
    if "--expert-model-parallel-size" in args:
        _set(args, mapping, "--expert-model-parallel-size", ep, "it must divide dp*cp")
    experts = max(4, 2 * ep)
    _set(args, mapping, "--num-experts", experts)
    if "--moe-router-topk" in args:
        _set(args, mapping, "--moe-router-topk", min(_int(args, "--moe-router-topk", 2), experts // 2))
    for flag in ("--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size"):
        if flag in args:
            _set(args, mapping, flag, HIDDEN)
    if "--moe-layer-freq" in args and not args["--moe-layer-freq"].strip().isdigit():
        _set(args, mapping, "--moe-layer-freq", 1, "the pattern is for the full layer count")
    for flag in ("--moe-router-num-groups", "--moe-router-group-topk"):
        if args.pop(flag, None) is not None:
            mapping.append(f"{flag} left out: the shrunk experts form one group")
    if args.get("--moe-expert-capacity-factor"):
        mapping.append("--moe-expert-capacity-factor kept: token dropping is part of the code path")
