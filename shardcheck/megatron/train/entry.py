"""A GPT pretraining entry point for ``megatron.training.pretrain``, written for ``shardcheck train``.

It does what Megatron-LM's ``pretrain_gpt.py`` does for a GPT on mock data: a model provider
(Megatron's local or Transformer Engine layer spec, with multi-latent attention under
``--multi-latent-attention``; its decoder-block spec with experts, so that ``--moe-layer-freq``
places them; the experimental attention variants' block spec, so that ``--linear-attention-freq``
places gated delta nets; the heterogeneous layers of ``--heterogeneous-layers-config-path``;
the MTP block of ``--mtp-num-layers``), or, for ``--hybrid-layer-pattern``,
what Megatron-LM's ``hybrid_builders.py`` builds (Megatron's ``HybridModel`` on megatron-core's
hybrid stack spec), a dataset
provider (``MockGPTDataset`` built on every rank), a forward step that cuts each rank's
context-parallel share of the batch, and the per-token language-model loss. Run as one rank
of a job::

    python -m shardcheck.megatron.train.entry MEGATRON-ARGS...

``SHARDCHECK_TRAIN_CPU=1`` turns on the CPU layer (:mod:`shardcheck.megatron.train.cpu`), and
with ``--transformer-impl transformer_engine`` Transformer Engine's CPU layer, installed before
megatron-core is imported (:func:`shardcheck.megatron.train.cpu.install_transformer_engine`);
``SHARDCHECK_TRAIN_ENTRY=script.py`` runs the user's own entry script instead of this one;
``SHARDCHECK_TRAIN_RECORD=folder`` records every step (:mod:`shardcheck.megatron.train.record`).
"""

from __future__ import annotations

import os
import runpy
import sys
from functools import partial
from typing import Any

CPU_ENV = "SHARDCHECK_TRAIN_CPU"
ENTRY_ENV = "SHARDCHECK_TRAIN_ENTRY"
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config: Any = None, pg_collection: Any = None) -> Any:
    """Megatron's ``GPTModel`` built from the command-line arguments (its ``HybridModel`` for a
    hybrid layer pattern)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = get_args()
    config = core_transformer_config_from_args(args)
    if args.hybrid_layer_pattern is not None:  # --hybrid-override-pattern too: Megatron copies it there
        return _hybrid_model(args, config, pre_process, post_process, vp_stage, pg_collection)
    return GPTModel(
        config=config, transformer_layer_spec=_layer_spec(args, config, vp_stage),
        mtp_block_spec=_mtp_spec(args, config, vp_stage),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage)


def _hybrid_model(args: Any, config: Any, pre_process: bool, post_process: bool, vp_stage: int | None,
                  pg_collection: Any) -> Any:
    """Megatron's ``HybridModel``, built as Megatron-LM's ``hybrid_builders.py`` builds it."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    return HybridModel(
        config=config, hybrid_stack_spec=_hybrid_stack_spec(args), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=pre_process, post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, pg_collection=pg_collection, vp_stage=vp_stage)


def _hybrid_stack_spec(args: Any) -> Any:
    """megatron-core's hybrid stack spec (``--spec`` names no other: planning refuses it), its MoE
    experts without grouped GEMM unless ``--moe-grouped-gemm`` (a CPU run drops it)."""
    from shardcheck.megatron.scenarios.hybrid import stack_spec

    return stack_spec(grouped_gemm=args.moe_grouped_gemm or not args.num_experts)


def _layer_spec(args: Any, config: Any, vp_stage: int | None = None) -> Any:
    """Megatron's layer spec; with an experimental attention variant, its block spec
    (``--linear-attention-freq``'s and ``--moe-layer-freq``'s patterns); with experts, its
    decoder-block spec (``--moe-layer-freq``'s pattern); with a heterogeneous layers config, its
    heterogeneous block spec (each layer's attention and MLP as the config's blocks say)."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as variants
    from megatron.core.models.gpt import gpt_layer_specs as specs

    te = args.transformer_impl == "transformer_engine"
    qk_l2_norm = getattr(args, "qk_l2_norm", False)
    if args.experimental_attention_variant is not None:  # Transformer Engine only (planning refuses local)
        return variants.get_transformer_block_with_experimental_attention_variant_spec(config=config,
                                                                                       vp_stage=vp_stage)
    if args.num_experts:
        spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=args.normalization,
                                                qk_l2_norm=qk_l2_norm, vp_stage=vp_stage)
    elif args.heterogeneous_layers_config_path is not None:  # config: a HeterogeneousTransformerConfig
        from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (
            get_gpt_heterogeneous_layer_spec,
        )

        spec = get_gpt_heterogeneous_layer_spec(config, te)
    elif te:  # CP with Transformer Engine is refused while planning: no stand-in to put in
        return specs.get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
            qk_l2_norm=qk_l2_norm)
    else:
        spec = specs.get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                              args.multi_latent_attention, normalization=args.normalization,
                                              qk_l2_norm=qk_l2_norm)
    if hasattr(spec, "layer_specs"):  # TE's CP attention has no CPU kernel: the stand-in
        spec.layer_specs = [_cpu_layer(config, layer) for layer in spec.layer_specs]
        return spec
    return _cpu_layer(config, spec)


def _cpu_layer(config: Any, spec: Any) -> Any:
    """``spec`` with the CPU stand-in for TE's CP attention, under the CPU layer."""
    if os.environ.get(CPU_ENV) != "1":
        return spec
    from shardcheck.megatron.cpu.cp_attention import local_spec_for

    return local_spec_for(config, spec)


def _mtp_spec(args: Any, config: Any, vp_stage: int | None) -> Any:
    """The multi-token prediction block's spec (``--mtp-num-layers``): layers like the last decoder
    layer, on the stage that holds them (None elsewhere, and without the flag)."""
    if not args.mtp_num_layers:
        return None
    from megatron.core.models.gpt import gpt_layer_specs as specs

    te = args.transformer_impl == "transformer_engine"
    if args.experimental_attention_variant is not None:
        from megatron.core.models.gpt import experimental_attention_variant_module_specs as variants

        last = variants.get_transformer_layer_with_experimental_attention_variant_spec(config=config)[-1]
    elif args.num_experts or args.heterogeneous_layers_config_path is not None:
        last = specs.get_gpt_decoder_layer_specs(config, te, normalization=args.normalization,
                                                 qk_l2_norm=getattr(args, "qk_l2_norm", False))[-1]
    else:
        last = _layer_spec(args, config, vp_stage)
    return specs.get_gpt_mtp_block_spec(config, _cpu_layer(config, last), use_transformer_engine=te,
                                        vp_stage=vp_stage)


def datasets_provider(num_samples: list[int], vp_stage: int | None = None) -> tuple[Any, Any, Any]:
    """Mock GPT train/valid/test datasets, the same on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, split=args.split,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True  # type: ignore[attr-defined] - every rank builds them


def loss_func(loss_mask: Any, output_tensor: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Summed token loss, the number of tokens, and both for Megatron's ``lm loss`` report."""
    import torch

    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.float().view(-1) * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1).float()])}


def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> tuple[Any, Any]:
    """One micro-batch through the model: this rank's context-parallel share of it."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = {k: v for k, v in next(data_iterator).items() if k in BATCH_KEYS and v is not None}
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                      cp_group=parallel_state.get_context_parallel_group())
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"], loss_mask=batch["loss_mask"])  # as pretrain_gpt.py: MTP's loss reads it
    return output, partial(loss_func, batch["loss_mask"])


def _pretrain() -> None:
    from megatron.core.enums import ModelType
    from megatron.training import training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    training.pretrain(pretrain_cfg_container_from_args(args), datasets_provider,
                      ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)


def main() -> None:
    """Set up this rank (CPU layer, recorder), then run the user's entry script or ours."""
    from shardcheck.megatron.train.cpu import (
        apply_training_patches,
        install_transformer_engine,
        patch_typing_override,
    )
    from shardcheck.megatron.train.record import StepRecorder, record_folder

    patch_typing_override()  # Python 3.11 compatibility, CPU or GPU
    if os.environ.get(CPU_ENV) == "1":
        install_transformer_engine(sys.argv[1:])  # before megatron-core is imported
        apply_training_patches()
    folder = record_folder()
    if folder is not None:
        StepRecorder(folder).install()
    script = os.environ.get(ENTRY_ENV)
    if script:
        sys.argv = [script, *sys.argv[1:]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` does
        runpy.run_path(script, run_name="__main__")
    else:
        _pretrain()


if __name__ == "__main__":
    main()
