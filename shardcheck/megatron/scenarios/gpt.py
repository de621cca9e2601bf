"""The GPT model end to end: schedules, DDP, finalize_model_grads and an optimizer step.

Run under any layout, it returns global values only (assembled from Megatron's own shard
metadata inside the scenario), so every output is replicated and comparable with the one-rank
run as is: the loss, every gradient after ``finalize_model_grads``, the gradient norm, the
clipping factor and every weight after one optimizer step.

Under a layout with explicit groups the model, DDP, the schedule (and through it
``finalize_model_grads``) and the optimizer get the explicit ``pg_collection``, and the
harness cuts and reduces its data over the same groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist

from shardcheck.megatron.cpu.parallel import (
    LayoutUnsupported,
    explicit_kwargs,
    megatron_parallel,
    scenario_groups,
    world_group,
)
from shardcheck.megatron.scenarios import heterogeneous
from shardcheck.megatron.scenarios.reference import (
    check_gradients_where_built,
    check_reduction_declarations,
    counted_in_grad_norm,
    gather_global,
    gradient_of,
    load_global_weights,
    note_declarations,
)


@dataclass(frozen=True)
class GPTSetup:
    """Sizes, data and training options of the tiny GPT; ``config`` overrides TransformerConfig."""

    hidden: int = 32
    heads: int = 4
    layers: int = 2
    vocab: int = 64
    seq: int = field(default=16, metadata={"fuzz": (8, 16)})
    micro_batch: int = field(default=2, metadata={"fuzz": (1, 2)})
    microbatches: int = field(default=2, metadata={"fuzz": (2, 4)})
    loss_mask: bool = False
    # GPTModel.forward's optional tensor inputs, drawn as a data pipeline makes them
    # (:func:`global_batches`): padded tokens at the end of each sequence, unevenly many; the
    # dataloader's causal attention mask, reset at document ends; packed sequences (THD, on
    # Transformer Engine only: :func:`packed`)
    padding_mask: bool = False
    attention_mask: bool = False
    packed_sequences: bool = False
    share_embeddings: bool = False
    # a Llama-Nemotron-style model: its layers of scenarios/heterogeneous.py's BLOCKS, each
    # attention and MLP full, left out or one linear layer (megatron-core's heterogeneous spec)
    heterogeneous: bool = False
    position_embedding: str = "learned_absolute"
    optimizer_step: bool = True
    clip_grad: float = 0.05
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    # GPTModel's own constructor and forward arguments beyond the ones set here, swept as
    # ``GPTModel.<arg>`` and ``GPTModel.forward.<arg>``
    model_args: dict[str, Any] = field(default_factory=dict)
    forward_args: dict[str, Any] = field(default_factory=dict)
    # The layers' implementation: "local" (Megatron's torch modules) or "te" (Transformer
    # Engine's own modules; megatron-core must have been imported after
    # shardcheck.megatron.cpu.te.install(), as the audit's TE rank pools do)
    impl: Literal["local", "te"] = "local"
    base_config: ClassVar[dict[str, Any]] = {}
    # the reduced gradients checked where megatron-core builds each parameter's module (as the
    # SSM scenarios check their layers'), not at the optimizer step
    gradients_where_built: ClassVar[bool] = False

    @property
    def layer_spec(self) -> str:
        """Megatron's name of the implementation (its ``--transformer-impl``)."""
        return "transformer_engine" if self.impl == "te" else "local"

    def config_type(self) -> type:
        """The Megatron config class of this setup's model."""
        if self.heterogeneous:
            return heterogeneous.config_type()
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig

    def build_model(self, config: Any, pg: Any = None) -> Any:
        """The Megatron model of this setup for this pipeline stage (:func:`build_gpt`)."""
        return build_gpt(config, self, pg)

    def derived_config(self) -> dict[str, Any]:
        """Config fields the setup's own options set (before ``config``'s overrides)."""
        return {}


@dataclass(frozen=True)
class TEGPTSetup(GPTSetup):
    """The tiny GPT from Megatron's Transformer Engine layer spec."""

    impl: Literal["local", "te"] = "te"


@dataclass(frozen=True)
class MoEGPTSetup(GPTSetup):
    """The tiny GPT with mixture-of-experts MLPs; ``config`` overrides apply on top."""

    base_config: ClassVar[dict[str, Any]] = {
        "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
        "add_bias_linear": False}


@dataclass(frozen=True)
class MTPGPTSetup(GPTSetup):
    """The tiny GPT with ``mtp_layers`` multi-token-prediction layers after its decoder."""

    mtp_layers: int = field(default=2, metadata={"fuzz": (1, 2)})
    # rotary positions, as megatron.training requires with MTP (learned absolute ones it
    # refuses at validate_args; they stay an option the sweep tries)
    position_embedding: str = "rope"

    def derived_config(self) -> dict[str, Any]:
        """Its MTP depth."""
        return {"mtp_num_layers": self.mtp_layers}


def transformer_config(layout: Any, setup: GPTSetup, **extra: Any):
    """A CPU-runnable TransformerConfig (the setup's :meth:`~GPTSetup.config_type`) for ``layout``
    with the setup's overrides applied."""
    options = dict(
        num_layers=setup.layers, hidden_size=setup.hidden, num_attention_heads=setup.heads,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=getattr(layout, "expert_tp", layout.tp),
        sequence_parallel=layout.sp, pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False, apply_rope_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False,
    )
    options.update(extra)
    options.update(setup.base_config)
    options.update(setup.derived_config())
    if setup.heterogeneous:
        options.update(heterogeneous.config_options())
    options.update(setup.config)
    return setup.config_type()(**options)


def global_batches(setup: GPTSetup) -> list[dict[str, torch.Tensor]]:
    """All microbatches of the global batch, identical on every rank and in every layout.

    ``loss_mask``: each token kept with probability 0.6, so the valid counts differ between
    sequences, micro-batches, data-parallel ranks and context-parallel pieces.
    ``padding_mask``: :func:`padded_tokens` pad tokens end each sequence (``padding_mask`` True
    there, the loss mask 0). ``attention_mask``: :func:`document_attention_mask`.
    ``packed_sequences``: each micro-batch one row of packed documents (:func:`packed`)."""
    gen = torch.Generator().manual_seed(1000 + setup.seed)
    shape = (setup.microbatches, setup.micro_batch, setup.seq)
    tokens = torch.randint(0, setup.vocab, shape, generator=gen)
    labels = torch.randint(0, setup.vocab, shape, generator=gen)
    mask = (torch.rand(shape, generator=gen) < 0.6).float() if setup.loss_mask else torch.ones(shape)
    positions = torch.arange(setup.seq).expand(shape).contiguous()
    inputs: dict[str, torch.Tensor] = {}
    if setup.padding_mask:
        padding = padded_tokens(setup)
        tokens = tokens.masked_fill(padding, PAD_TOKEN)
        mask = mask.masked_fill(padding, 0.0)
        inputs["padding_mask"] = padding
    if setup.attention_mask:
        inputs["attention_mask"] = document_attention_mask(setup)
    batches = [dict(tokens=tokens[i], labels=labels[i], loss_mask=mask[i], position_ids=positions[i],
                    **{name: value[i] for name, value in inputs.items()})
               for i in range(setup.microbatches)]
    return [packed(setup, i, batch) for i, batch in enumerate(batches)] if setup.packed_sequences else batches


PAD_TOKEN = 0
PACKED_ON_CPU = ("packed sequences (THD, cu_seqlens) need Transformer Engine's attention (impl=te): "
                 "megatron-core's local DotProductAttention refuses them")
PACKED_UNDER_CP = ("packed sequences (THD) under context parallelism need Transformer Engine's "
                   "thd_* CP kernels, which shardcheck's CPU extension does not implement")
PACKED_WITH_MASK = ("packed sequences carry their document boundaries in cu_seqlens: an explicit "
                    "attention mask beside them is not drawn")


def document_bounds(setup: GPTSetup, n: int) -> torch.Tensor:
    """The n-th sequence of the global batch as packed documents: its ``cu_seqlens`` (int32),
    starts at ``(3n + 5) mod (seq - 2) + 1`` and ``(7n + 2) mod (seq - 2) + 1``, so the lengths
    are uneven (3, 3, 10; 9, 1, 6; 3, 9, 4; ... at seq 16); the last document runs to the end, as
    Megatron's SFT packing pads it."""
    starts = {(3 * n + 5) % (setup.seq - 2) + 1, (7 * n + 2) % (setup.seq - 2) + 1}
    return torch.tensor(sorted({0, *starts, setup.seq}), dtype=torch.int32)


def packed(setup: GPTSetup, index: int, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Micro-batch ``index`` (sequences ``[micro_batch, seq]``) as Megatron's data pipeline gives
    packed documents to ``GPTModel`` (``flatten_batch_for_packed_sequences``): each sequence its
    :func:`document_bounds`, position ids reset at each document start, and the sequences
    packed into one row (:func:`pack`)."""
    rows = []
    for j in range(setup.micro_batch):
        bounds = document_bounds(setup, index * setup.micro_batch + j)
        position = torch.arange(setup.seq)
        document = torch.searchsorted(bounds[1:], position, right=True)
        row = {name: value[j][None] for name, value in batch.items()}
        rows.append(row | {"position_ids": (position - bounds[document])[None], "cu_seqlens": bounds})
    return pack(rows)


def pack(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Packed micro-batches (one row ``[1, t]`` each, with their ``cu_seqlens``) as one: rows
    joined, document bounds shifted and merged."""
    offsets = [0, *torch.tensor([b["tokens"].shape[-1] for b in batches]).cumsum(0).tolist()]
    bounds = [b["cu_seqlens"][:-1] + offset for b, offset in zip(batches, offsets[:-1], strict=True)]
    joined = {name: torch.cat([b[name] for b in batches], dim=-1) for name in batches[0] if name != "cu_seqlens"}
    return joined | {"cu_seqlens": torch.cat([*bounds, torch.tensor([offsets[-1]], dtype=torch.int32)])}


def packed_seq_params(cu_seqlens: torch.Tensor) -> Any:
    """Megatron's ``PackedSeqParams`` for one packed micro-batch, as ``pretrain_gpt.py``'s
    ``forward_step`` builds them from a batch without padding between documents (no
    ``cu_seqlens_padded``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def padded_tokens(setup: GPTSetup) -> torch.Tensor:
    """[microbatches, micro_batch, seq], True at padding: the n-th sequence of the global batch
    ends with ``(5n + 3) mod seq/2`` pad tokens (3, 0, 5, 2, ... at seq 16), so the padded counts
    differ between micro-batches, data-parallel ranks and context-parallel pieces."""
    count = setup.microbatches * setup.micro_batch
    pads = (torch.arange(count) * 5 + 3) % (setup.seq // 2)
    padding = torch.arange(setup.seq)[None, :] >= (setup.seq - pads)[:, None]
    return padding.reshape(setup.microbatches, setup.micro_batch, setup.seq)


def document_attention_mask(setup: GPTSetup) -> torch.Tensor:
    """[microbatches, micro_batch, 1, seq, seq], True where attention is masked: causal, and
    reset at each document's end, as Megatron's ``get_ltor_masks_and_position_ids`` makes it
    with ``reset_attention_mask``. The n-th sequence's second document starts at ``(3n + 5)
    mod (seq - 2) + 1``."""
    count = setup.microbatches * setup.micro_batch
    starts = (torch.arange(count) * 3 + 5) % (setup.seq - 2) + 1
    position = torch.arange(setup.seq)
    document = (position[None, :] >= starts[:, None]).int()  # [count, seq]: 0, then 1
    later = position[None, :, None] < position[None, None, :]  # key after query
    other = document[:, :, None] != document[:, None, :]
    return (later | other)[:, None].reshape(setup.microbatches, setup.micro_batch, 1, setup.seq, setup.seq)


# MoE load-balancing losses that are a mean over sequences (each sequence's loss computed on its
# own tokens), so independent of how sequences are grouped into micro-batches
PER_SEQUENCE_AUX_LOSSES = frozenset({"seq_aux_loss"})


def aux_loss_coeffs(config) -> list[tuple[str, float]]:
    """Each MoE load-balancing loss type with its coefficient, as the router reads them
    (``TopKRouter.get_aux_loss_coeff``): one type and coefficient, or a list of each."""
    kinds, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    return list(zip(*(([kinds], [coeffs]) if isinstance(kinds, str) else (kinds, coeffs)), strict=False))


def split_free(config) -> bool:
    """Whether Megatron's loss does not depend on how the global batch is split into
    micro-batches: per-token loss (summed over tokens, then divided by the global token count)
    with no loss term computed over a micro-batch as a whole (MoE's z loss, its load-balancing
    losses but the sequence-level one, :data:`PER_SEQUENCE_AUX_LOSSES`)."""
    per_micro_batch = [c for kind, c in aux_loss_coeffs(config) if kind not in PER_SEQUENCE_AUX_LOSSES]
    return bool(config.calculate_per_token_loss) and not any([*per_micro_batch, config.moe_z_loss_coeff])


def local_batches(setup: GPTSetup, pg: Any = None, whole: bool = False) -> list[dict[str, torch.Tensor]]:
    """This rank's microbatches: a contiguous share per data-parallel rank, cut for its CP rank.
    ``whole`` (one rank only): the whole global batch in one micro-batch."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from shardcheck.megatron.cpu.versions import cp_batch_kwargs

    batches = global_batches(setup)
    if whole:
        if setup.packed_sequences:
            return [pack(batches)]
        return [{name: torch.cat([b[name] for b in batches]) for name in batches[0]}]
    used = scenario_groups(pg)
    dp, dp_rank = used.dp.size(), used.dp.rank()
    if setup.microbatches % dp:
        raise ValueError(f"{setup.microbatches} microbatches do not split over dp={dp}")
    share = setup.microbatches // dp
    mine = batches[dp_rank * share:(dp_rank + 1) * share]
    if setup.attention_mask and used.cp.size() > 1:
        raise LayoutUnsupported("an explicit attention mask under context parallelism needs "
                                "Transformer Engine's CP attention (no CPU kernel)")
    if setup.packed_sequences and used.cp.size() > 1:
        raise LayoutUnsupported(PACKED_UNDER_CP)
    # the CP group always given: without one, 0.19 cuts over the whole world, not parallel_state's cp
    release = cp_batch_kwargs(get_batch_on_this_cp_rank)
    return [get_batch_on_this_cp_rank(dict(batch), cp_group=used.cp, **release) for batch in mine]


def build_gpt(config, setup: GPTSetup, pg: Any = None):
    """A GPTModel with the setup's layer spec (local: no Transformer Engine) for this pipeline
    stage."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_model import GPTModel

    from shardcheck.megatron.cpu.cp_attention import local_spec_for

    options = dict(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm,
                   qk_l2_norm=config.qk_l2_norm, multi_latent_attention=config.multi_latent_attention)
    # only TE's spec has the fused MLA down projection (FusedMLASelfAttention)
    fused_mla = {"mla_down_proj_fusion": True} if getattr(config, "mla_down_proj_fusion", False) else {}
    if setup.heterogeneous:
        spec = heterogeneous.layer_specs(config, setup.layer_spec == "transformer_engine")
    elif setup.layer_spec == "transformer_engine":  # TE's norms read config.normalization
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**options, **fused_mla)
    else:
        spec = local_spec_for(config, gpt_layer_specs.get_gpt_layer_local_spec(
            normalization=config.normalization, **options))
    pp = scenario_groups(pg).pp
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=setup.vocab,
        max_sequence_length=setup.seq, pre_process=pp.rank() == 0,
        post_process=pp.rank() == pp.size() - 1,
        share_embeddings_and_output_weights=setup.share_embeddings,
        position_embedding_type=setup.position_embedding,
        mtp_block_spec=_mtp_spec(config, spec, setup.layer_spec == "transformer_engine"),
        **setup.model_args, **explicit_kwargs(pg),
    )


def _mtp_spec(config, layer_spec, transformer_engine: bool):
    """Megatron's MTP block spec (its own modules local or Transformer Engine's, as the
    decoder's) when the config asks for MTP layers, else None."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=transformer_engine)


def masked_loss(batch: dict[str, torch.Tensor], output: torch.Tensor):
    """Megatron's training loss function: (sum of masked losses, token count, report)."""
    mask = batch["loss_mask"].reshape(-1).float()
    loss_sum = (output.float().reshape(-1) * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def _forward_step(batches, forward_args: dict[str, Any]):
    batch_iter = iter(batches)

    # the schedule passes a third argument under num_microbatches_with_partial_activation_checkpoints:
    # whether to checkpoint this micro-batch, for a model that can; no megatron-core model takes it
    def forward_step(_data_iterator, model, _checkpoint_activations_microbatch=None):
        batch = next(batch_iter)
        packing = {"packed_seq_params": packed_seq_params(batch["cu_seqlens"])} if "cu_seqlens" in batch else {}
        # the loss mask reaches the model too (MTP's loss reads it), as pretrain_gpt.py gives it
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                       labels=batch["labels"], loss_mask=batch["loss_mask"],
                       padding_mask=batch.get("padding_mask"), **packing, **forward_args)
        return output, lambda out: masked_loss(batch, out)

    return forward_step


def reported_loss(reports: list[torch.Tensor], per_token: bool, pg: Any = None) -> torch.Tensor:
    """The global loss: mean of microbatch means (or, per token, total sum / total count)."""
    used = scenario_groups(pg)
    per_mb = torch.stack(reports) if reports else torch.zeros(0, 2)
    dist.all_reduce(per_mb, group=used.cp)
    if per_token:
        total = per_mb.sum(0)
    else:
        total = torch.stack([(per_mb[:, 0] / per_mb[:, 1].clamp(min=1)).sum(),
                             torch.tensor(float(len(reports)))])
    dist.all_reduce(total, group=used.dp)
    dist.all_reduce(total, group=used.pp)
    return (total[0] / total[1].clamp(min=1))


FP16_INITIAL_LOSS_SCALE = 2.0 ** 8


def half_dtype(config) -> torch.dtype | None:
    """The 16-bit dtype a config asks for (``bf16`` or ``fp16``), else None."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


def _optimizer(model, setup: GPTSetup, pg: Any = None, half: torch.dtype | None = None):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # SGD: the step is linear in the gradients, so rounding in them stays rounding after it
    # (Adam divides tiny gradients by their own size and turns rounding into visible changes).
    # In 16 bits, Megatron's mixed-precision optimizer: fp32 main params and grads, and for
    # fp16 the dynamic loss scaler.
    config = OptimizerConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.0, clip_grad=setup.clip_grad,
                             weight_decay=0.0, bf16=half is torch.bfloat16, fp16=half is torch.float16,
                             params_dtype=half or torch.float32,
                             initial_loss_scale=FP16_INITIAL_LOSS_SCALE)
    return get_megatron_optimizer(config, [model], use_gloo_process_groups=False,
                                  **explicit_kwargs(pg))


@dataclass
class Training:
    """A built GPT on this rank's layout: its config, model, DDP wrapper and optimizer."""

    config: Any
    model: Any
    ddp: Any
    optimizer: Any
    setup: GPTSetup
    pg: Any = None

    @property
    def whole_batch(self) -> bool:
        """Whether this run is a one-rank reference of a loss that does not depend on the split
        (:func:`split_free`): it then takes the whole global batch in one micro-batch, so a
        parallel run whose result depends on its micro-batches or data-parallel shares parts
        ways with it."""
        used = scenario_groups(self.pg)
        alone = all(group.size() == 1 for group in (used.tp, used.cp, used.dp, used.pp))
        return alone and split_free(self.config)

    def _seq_length(self, batches: list[dict[str, torch.Tensor]]) -> int:
        """The schedule's sequence length: a packed micro-batch's row (its tokens all in one
        sequence of the batch), else the setup's."""
        return batches[0]["tokens"].shape[-1] if self.setup.packed_sequences else self.setup.seq

    def forward_backward(self) -> tuple[list[dict], int]:
        """Zero the gradients, run Megatron's schedule over this rank's microbatches (forward,
        backward, ``finalize_model_grads``); the loss reports (on the last pipeline stage) and
        the number of microbatches."""
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        self.ddp.zero_grad_buffer()
        _fresh_mtp_logs()
        _fresh_moe_logs()
        batches = local_batches(self.setup, self.pg, whole=self.whole_batch)
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step(batches, self.setup.forward_args), data_iterator=None,
            model=[self.ddp],
            num_microbatches=len(batches), seq_length=self._seq_length(batches),
            micro_batch_size=batches[0]["tokens"].shape[0], forward_only=False,
            **schedule_groups(self.pg, self.config))
        return reports, len(batches)


def build_training(ctx: Any, setup: GPTSetup, pg: Any = None) -> Training:
    """The tiny GPT with its reference weights, DDP and (``setup.optimizer_step``) optimizer,
    inside ``megatron_parallel(ctx)`` (which yields ``pg``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = transformer_config(ctx.layout, setup)
    half = half_dtype(config)
    if half is not None:  # 16-bit weights and activations, as Megatron's training runs them
        config.params_dtype = config.pipeline_dtype = half
    model = setup.build_model(config, pg)
    load_global_weights(model, seed=setup.seed)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=half is not None),
                                  _in_half(config, model, half), **explicit_kwargs(pg))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    optimizer = _optimizer(ddp, setup, pg, half) if setup.optimizer_step else None
    if optimizer is not None and half is torch.float16:
        config.grad_scale_func = optimizer.scale_loss
    return Training(config, model, ddp, optimizer, setup, pg)


def train_step(ctx: Any, setup: GPTSetup) -> dict[str, torch.Tensor]:
    """One training step of the tiny GPT on ``ctx``'s layout; global values by name."""
    if setup.packed_sequences and setup.impl != "te":
        raise LayoutUnsupported(PACKED_ON_CPU)
    if setup.packed_sequences and setup.attention_mask:
        raise LayoutUnsupported(PACKED_WITH_MASK)
    with megatron_parallel(ctx) as pg:
        training = build_training(ctx, setup, pg)
        config, model, optimizer = training.config, training.model, training.optimizer
        note_declarations(model)
        reports, microbatches = training.forward_backward()
        check_reduction_declarations(training.ddp)
        if setup.gradients_where_built:
            check_gradients_where_built(model)
        outputs = {"loss": reported_loss([r["lm loss"] for r in reports],
                                         config.calculate_per_token_loss, pg)}
        if config.mtp_num_layers:
            outputs.update(mtp_metrics(microbatches, pg, with_loss=not split_free(config)))
        if config.num_moe_experts:
            outputs.update(moe_metrics(config, microbatches, pg))
        grads, spread = gather_global(model, gradient_of, world_group(ctx))
        outputs.update({f"grad/{k}": v for k, v in grads.items()})
        outputs["grad_replica_spread"] = torch.tensor(max(spread.values()))
        if optimizer is not None:
            with _gradients_unchecked_at_step(setup.gradients_where_built):
                outputs.update(_step(ctx, model, optimizer))
        return outputs


@contextmanager
def _gradients_unchecked_at_step(unchecked: bool) -> Iterator[None]:
    """The checker's gradient check before ``optimizer.step`` off (``unchecked``: the gradients
    were checked where their parameters are built), so a gradient is reported once."""
    from shardcheck.typecheck.checker import current

    checker = current()
    if not unchecked or checker is None:
        yield
        return
    before, checker.check_gradients_on_step = checker.check_gradients_on_step, False
    try:
        yield
    finally:
        checker.check_gradients_on_step = before


def _fresh_mtp_logs() -> None:
    """Forget what earlier runs in this process logged for MTP (a class-level tracker)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def _fresh_moe_logs() -> None:
    """Forget the MoE metrics earlier runs in this process recorded, their names too (a
    module-level tracker: 0.19's ``MoEMetricsTracker``, a plain dict before)."""
    from megatron.core.transformer.moe import moe_utils

    tracker = getattr(moe_utils, "get_moe_metrics_tracker", None)
    if tracker is not None:
        tracker()._metrics.clear()
    else:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def moe_metrics(config, num_microbatches: int, pg: Any = None) -> dict[str, torch.Tensor]:
    """The MoE metrics (load-balancing and z losses) as Megatron's training loop logs them
    after a step (``track_moe_metrics``: summed over the pipeline stages and each metric's
    reduce group, averaged over its average group and data parallelism), on every rank.
    The names are those any pipeline stage recorded: a stage without MoE layers reports zeros."""
    from megatron.core.transformer.moe.moe_utils import (
        get_moe_layer_wise_logging_tracker,
        track_moe_metrics,
    )

    pp = scenario_groups(pg).pp
    names: list[Any] = [None] * pp.size()
    dist.all_gather_object(names, sorted(get_moe_layer_wise_logging_tracker()), group=pp)
    writer = _Scalars()
    track_moe_metrics(1.0 / num_microbatches, 0, writer, force_initialize=True,
                      track_names=sorted({name for ranks in names for name in ranks}),
                      num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq,
                      mtp_num_layers=config.mtp_num_layers, pg_collection=pg)
    return {f"moe/{name}": torch.tensor(value, dtype=torch.float64) for name, value in writer.values.items()}


class _Scalars:
    """A stand-in for a tensorboard writer: keeps what Megatron logs, by name."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add_scalar(self, name: str, value: Any, _iteration: int) -> None:
        self.values[name] = float(value)


def mtp_metrics(num_microbatches: int, pg: Any = None, with_loss: bool = True) -> dict[str, torch.Tensor]:
    """The MTP losses and acceptance rates as Megatron's training loop logs them after a step
    (``track_mtp_metrics``, which reduces them over the last stage's ranks), on every rank.
    The cumulative rates are left out: they add up over the steps a process has run. Without
    ``with_loss`` the logged losses are left out too: each is a mean of micro-batch means,
    defined by the split, so a whole-batch reference (:func:`split_free`) has none to match."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    writer = _Scalars()
    MTPLossLoggingHelper.track_mtp_metrics(1.0 / num_microbatches, 0, writer)
    pp = scenario_groups(pg).pp
    stages: list[Any] = [None] * pp.size()
    dist.all_gather_object(stages, writer.values, group=pp)  # only the last stage logs them
    return {f"mtp/{name}": torch.tensor(value, dtype=torch.float64)
            for logged in stages for name, value in logged.items()
            if "cumulative" not in name and (with_loss or not name.endswith(" loss"))}


def _in_half(config, model, half: torch.dtype | None):
    """The model as Megatron trains it in 16 bits (``Float16Module``: inputs cast in, outputs
    cast back to fp32), or itself in fp32."""
    if half is None:
        return model
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, model)


def schedule_groups(pg: Any, config) -> dict[str, Any]:
    """The schedule's explicit groups: the collection, and a P2P communicator over its pp group."""
    if pg is None:
        return {}
    if pg.pp.size() == 1:
        return {"pg_collection": pg}
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    return {"pg_collection": pg, "p2p_communicator": P2PCommunicator(pp_group=pg.pp, config=config)}


def _step(ctx: Any, model, optimizer) -> dict[str, torch.Tensor]:
    _, grad_norm, _ = optimizer.step()
    clip = optimizer.config.clip_grad
    weights, _ = gather_global(model, lambda p: p.data, world_group(ctx))
    out = {f"param/{k}": v for k, v in weights.items()}
    out["grad_norm"] = torch.tensor(float(grad_norm))
    out.update(counted_in_grad_norm(model, optimizer))
    out["clip_factor"] = torch.tensor(min(1.0, clip / (float(grad_norm) + 1e-6)))
    return out
