"""What ``megatron.training``'s own argument validation says of a finding's configuration.

megatron-core builds models that ``pretrain`` would never build: ``validate_args`` in
``megatron/training/arguments.py`` refuses some configurations the core classes accept (MTP
with learned absolute position embeddings). A finding under such a configuration is still a
bug of megatron-core, but a training job never reaches it, so the finding says so, with the
line that refuses it (:func:`training_verdict`).

The configuration is translated into the flags ``pretrain`` takes: Megatron's own parser
defaults, with every ``TransformerConfig`` field the case sets (any field whose built value
differs from a plain config's: the harness's CPU choices, the options, what ``__post_init__``
derives from them) and the model's sizes copied to the flag of the same name (``num_moe_experts`` is
``--num-experts``), the layout's parallel sizes, and the GPT setup's own choices (position
embedding, tied embeddings, sequence length, batch sizes, gradient clipping, the model
arguments that are flags of the same name), with the local layer spec the scenarios build.
Hardware is not a configuration: the validation runs as on a GPU that asks for no
``CUDA_DEVICE_MAX_CONNECTIONS`` setting (device architecture 10), and a case on Transformer
Engine as with the TE its ranks run installed. Only the components that
build a ``GPTModel`` from a GPT setup are checked: ``pretrain_gpt`` would build them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import io
import traceback
import typing
import warnings
from typing import Any

from shardcheck.megatron.audit.sweep import SIZE_FIELDS, Case, impl_of, setup_kwargs
from shardcheck.megatron.checks.paths import megatron_path
from shardcheck.patching import patched

REFUSES = "megatron.training refuses it"
NOT_CHECKED = "megatron.training's argument validation could not check it"
REFUSED_TYPES = (AssertionError, ValueError)  # how validate_args says no
# TransformerConfig fields whose flag has another name (core_transformer_config_from_args)
FLAG_NAMES = {"num_moe_experts": "num_experts",
              "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
              "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers"}
LAYOUT_FLAGS = frozenset({"tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                          "expert_model_parallel_size", "expert_tensor_parallel_size",
                          "sequence_parallel"})
DEVICE_ARCH = 10  # validate_args's CUDA_DEVICE_MAX_CONNECTIONS demand stops at Blackwell


@functools.cache
def loaded_validation() -> tuple[Any, argparse.Namespace] | str:
    """megatron.training's ``arguments`` module and its parser's defaults, or why it does not
    import (another release than megatron-core's, or none shipped). Its package imports
    ``typing.override`` (Python 3.12), the identity at run time: set only for the import."""
    try:
        with patched(typing, "override", getattr(typing, "override", lambda f: f)), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed", ...
            from megatron.training import arguments
    except ImportError as why:
        return f"megatron.training does not import with this megatron-core ({why})"
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False, add_help=False))
    return arguments, parser.parse_args([])


def built_by_pretrain_gpt(component: str) -> bool:
    """Whether the component builds a ``GPTModel`` from a GPT setup, as ``pretrain_gpt`` would."""
    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.megatron.scenarios.gpt import GPTSetup

    return issubclass(COMPONENTS[component].setup, GPTSetup)


def training_flags(case: Case, defaults: argparse.Namespace) -> argparse.Namespace:
    """The flags of a training job that builds the case's model (a GPT setup's) under its
    layout, on top of Megatron's parser ``defaults`` (see the module's docstring)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.megatron.scenarios.gpt import transformer_config

    entry = COMPONENTS[case.component]
    setup = entry.setup(**setup_kwargs(entry.setup, case.options))
    config = transformer_config(case.layout, setup)
    plain = TransformerConfig(num_layers=config.num_layers, hidden_size=config.hidden_size,
                              num_attention_heads=config.num_attention_heads)
    flags = copy.deepcopy(defaults)
    for f in dataclasses.fields(TransformerConfig):
        name = FLAG_NAMES.get(f.name, f.name)
        value = getattr(config, f.name)
        if hasattr(flags, name) and (f.name in SIZE_FIELDS | LAYOUT_FLAGS or value != getattr(plain, f.name)):
            setattr(flags, name, value)
    flags.group_query_attention = config.num_query_groups not in (None, config.num_attention_heads)
    for name, value in setup.model_args.items():
        if hasattr(flags, name):
            setattr(flags, name, value)
    flags.position_embedding_type = setup.position_embedding
    flags.untie_embeddings_and_output_weights = not setup.share_embeddings
    flags.seq_length = flags.max_position_embeddings = setup.seq
    flags.micro_batch_size = setup.micro_batch
    flags.global_batch_size = setup.micro_batch * setup.microbatches * case.layout.dp
    flags.clip_grad = setup.clip_grad
    flags.transformer_impl = "local" if setup.layer_spec == "local" else "transformer_engine"
    flags.rank, flags.world_size = 0, case.layout.world_size
    flags._is_global_batch_size_explicitly_specified = True  # as parse_args sets it
    return flags


@functools.cache
def training_verdict(case: Case) -> str | None:
    """None when megatron.training's ``validate_args`` accepts the case's configuration (or the
    component is no GPT); else one line: ``megatron.training refuses it: <error>
    (megatron/training/arguments.py:<line> in <function>)``, or why it could not check it."""
    if not built_by_pretrain_gpt(case.component):
        return None
    loaded = loaded_validation()
    if isinstance(loaded, str):
        return f"{NOT_CHECKED}: {loaded}"
    arguments, defaults = loaded
    try:
        flags = training_flags(case, defaults)
    except Exception as exc:  # noqa: BLE001 - megatron-core's own config refuses the layout first
        return f"{NOT_CHECKED}: its TransformerConfig does not build ({_said(exc)})"
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), \
                patched(arguments, "get_device_arch_version", lambda: DEVICE_ARCH), \
                _with_te_of(case, arguments):
            warnings.simplefilter("ignore")
            arguments.validate_args(flags, {})  # prints every argument: kept off stdout
    except Exception as exc:  # noqa: BLE001 - a refusal, or a check that cannot run here: said so
        frames = traceback.extract_tb(exc.__traceback__)
        frame = [f for f in frames if f.filename == arguments.__file__][-1]  # validate_args's line
        where = f"{megatron_path(frame.filename)}:{frame.lineno} in {frame.name}"
        return f"{REFUSES if isinstance(exc, REFUSED_TYPES) else NOT_CHECKED}: {_said(exc)} ({where})"
    return None


def crash_training_verdict(case: Case) -> str | None:
    """:func:`training_verdict` for a crash on one rank: its one-rank run is the reference of the
    option set's cases under every layout, so the options are refused only when
    ``validate_args`` refuses them under every layout the component runs (a one-rank layout
    alone refuses ``distribute_saved_activations``, which needs tp > 1); the one-rank
    verdict is given then."""
    from shardcheck.megatron.audit.sweep import layouts
    from shardcheck.megatron.scenarios import COMPONENTS

    alone = training_verdict(case)
    if alone is None or not alone.startswith(REFUSES):
        return alone
    runnable = (layout for layout in layouts() if COMPONENTS[case.component].refuses(layout) is None)
    accepted = any(training_verdict(case.with_layout(layout)) is None for layout in runnable)
    return None if accepted else alone


def _with_te_of(case: Case, arguments: Any) -> contextlib.AbstractContextManager[None]:
    """For a case on Transformer Engine, ``validate_args``'s TE version checks answer for the
    pinned TE its ranks run (this process imported no TE: every check would fail, ``--fp4-format``
    refused for want of TE 2.7); nothing otherwise."""
    if impl_of(case.options, case.component) != "te":
        return contextlib.nullcontext()
    from packaging.version import Version

    from shardcheck.megatron.cpu.te import TE_VERSION

    def pinned_at_least(version: str, check_equality: bool = True) -> bool:
        pinned, wanted = Version(TE_VERSION), Version(version)
        return pinned >= wanted if check_equality else pinned > wanted

    return patched(arguments, "is_te_min_version", pinned_at_least)


def _said(exc: BaseException) -> str:
    """An exception's last line: its type and message."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip()
