"""The code of the audit's repro scripts, as text: shared helpers, CPU patches, components.

:mod:`shardcheck.megatron.repro.templates` picks the pieces a finding needs and puts them
together; each piece here is plain script code, run by ``torchrun`` without shardcheck.
Every component's ``run(sizes, pg)`` gets the process groups its model is given (``pg``, a
``ProcessGroupCollection``) and returns the same global values in every layout. The CPU
stand-ins of CUDA-only code are the harness's own (:mod:`shardcheck.megatron.cpu`), their
source read with :func:`harness_source`, so a script runs the kernels and patches the audit ran.
"""

import ast
import inspect
import textwrap

from shardcheck.megatron.cpu import kernels, patches


def harness_source(*objects: object) -> str:
    """The source of the harness's ``objects`` (functions, classes) as a script defines them:
    their code as it is, without their docstrings (documented where they live)."""
    return "\n\n\n".join(without_docstrings(textwrap.dedent(inspect.getsource(obj)).strip())
                          for obj in objects)


def without_docstrings(source: str) -> str:
    """``source`` without the lines of its functions' and classes' docstrings."""
    docstrings = {line for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and len(node.body) > 1
                  and ast.get_docstring(node) is not None
                  for line in range(node.body[0].lineno, node.body[0].end_lineno + 1)}
    return "\n".join(line for number, line in enumerate(source.splitlines(), 1) if number not in docstrings)


BASE = '''
def run_on(sizes, check=False):
    """``run`` on megatron's process groups for ``sizes`` (data parallelism takes the rest of the
    world); with ``check``, under shardcheck's type checker when it is installed."""
    global CHECKER
    pg = process_groups(sizes)
    if check and CHECKER:
        try:  # optional, only for the checker: line
            from shardcheck.megatron.repro.check import checked_run
        except ImportError:
            CHECKER = None  # no checker here to confirm the line the audit recorded
        else:
            result, CHECKER = checked_run(run, sizes, pg, CHECKER)
            return result
    return run(sizes, pg)


def process_groups(sizes):
    """parallel_state's groups in rank order ``order``; returns the model's: those of ``model_order``."""
    collections = []
    for order in dict.fromkeys([sizes["model_order"], sizes["order"]]):  # the globals' order last
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(sizes["tp"], sizes["pp"], context_parallel_size=sizes["cp"],
                                     expert_model_parallel_size=sizes["ep"], order=order,
                                     create_gloo_process_groups=False)
        collections.append(ProcessGroupCollection.use_mpu_process_groups())
    return collections[0]


def config_for(sizes, **options):
    """A CPU-runnable TransformerConfig for ``sizes`` with the component's and finding's options."""
    return TransformerConfig(**{
        "num_layers": 1, "hidden_size": SETUP["hidden"], "num_attention_heads": 4,
        "use_cpu_initialization": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "tensor_model_parallel_size": sizes["tp"], "context_parallel_size": sizes["cp"],
        "pipeline_model_parallel_size": sizes["pp"], "expert_model_parallel_size": sizes["ep"],
        "sequence_parallel": sizes["sp"],
        "pipeline_dtype": torch.float32, "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False, "masked_softmax_fusion": False, "apply_rope_fusion": False,
        **options, **OVERRIDES})
'''

SEEDED = '''
def seeded(key, *shape):
    """A global tensor that depends only on ``key`` and its shape: the same in every layout."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))
'''

PIECES = '''
def gather(tensor, dim, group):
    """The global tensor from each rank's piece along ``dim`` over ``group``."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
'''

SHARD = '''
def shard(tensor, sizes, group):
    """This rank's sequence chunk (dim 0) under sequence parallelism, else the whole tensor."""
    return tensor.chunk(group.size())[group.rank()] if sizes["sp"] else tensor
'''

WEIGHTS = '''
def load_weights(model, pg):
    """Seeded global weights, the same in every layout (an expert's by its global index); a
    sharded weight gives each rank its piece, cut on the dim where its shape is smaller, section
    by section when it is fused."""
    for local_name, param in model.named_parameters():
        name, group = global_name(local_name, pg)
        full = seeded(name, *FULL.setdefault(name, param.shape)) * 0.2
        dim = next((d for d, (a, b) in enumerate(zip(full.shape, param.shape)) if a != b), None)
        if dim is not None:
            sections = next((s for key, s in SECTIONS.items() if name.endswith(key)), [full.shape[dim]])
            full = torch.cat([s.chunk(group.size(), dim)[group.rank()] for s in full.split(sections, dim)], dim)
        param.data.copy_(full)


def global_name(name, pg):
    """A parameter's name in the one-rank model (layer and expert indices count those of the pp
    and ep ranks before; MTP's layers follow the decoder's on the last stage, numbered on their
    own), and the group it is sharded over: tp, or expert tp for an expert."""
    for word, group, total in (("layers", pg.pp, SETUP.get("layers")),
                               ("local_experts", pg.ep, OVERRIDES.get("num_moe_experts"))):
        name = re.sub(rf"(?<!mtp\\.)\\b{word}\\.(\\d+)\\.",  # MTP layers: all on the last stage
                      lambda m: f"{word}.{group.rank() * total // group.size() + int(m[1])}.", name)
    if SETUP.get("share_embeddings") and name == "output_layer.weight":  # the last stage's copy
        name = "embedding.word_embeddings.weight"
    return name, pg.expt_tp if "local_experts." in name else pg.tp


def grad_norms(model, pg, counted=None):
    """The norm of every parameter's global gradient, in the one-rank model's order: the squares
    of its shards summed, from the stage (and for an expert the ep rank) that holds it; with
    ``counted`` (the gradients megatron's norm counts), of what the norm counts of it."""
    squares = dict.fromkeys(FULL, torch.zeros(()))
    for local_name, param in model.named_parameters():
        name, group = global_name(local_name, pg)
        kept = counted is None or id(param.main_grad) in counted
        squares[name] = param.main_grad.float().pow(2).sum() * float(kept)
        if counted is not None or param.shape != FULL[name]:
            dist.all_reduce(squares[name], group=group)
    squares = torch.stack(list(squares.values()))
    expert = torch.tensor(["local_experts." in name for name in FULL])
    experts = squares * expert
    dist.all_reduce(experts, op=dist.ReduceOp.MAX, group=pg.ep)  # the other ep ranks hold 0
    squares = torch.where(expert, experts, squares)
    dist.all_reduce(squares, op=dist.ReduceOp.MAX, group=pg.pp)  # the other stages hold 0
    return squares.sqrt()


FULL = {}  # each parameter's global shape, from the reference run (it runs first)
'''

OUTPUT_LOSS = '''
def run(sizes, pg):
    """ColumnParallelLinear logits into vocab_parallel_cross_entropy: [loss, weight grad, input grad]."""
    config = config_for(sizes)
    layer = tensor_parallel.ColumnParallelLinear(
        SETUP["hidden"], SETUP["vocab"], config=config, init_method=config.init_method, bias=False,
        gather_output=not SETUP["parallel_output"], tp_group=pg.tp)
    layer.weight.data.copy_(seeded("weight", SETUP["vocab"], SETUP["hidden"]).chunk(pg.tp.size())[pg.tp.rank()] * 0.05)
    hidden = seeded("hidden", SETUP["seq"], SETUP["batch"], SETUP["hidden"])
    labels = torch.randint(0, SETUP["vocab"], (SETUP["seq"], SETUP["batch"]),
                           generator=torch.Generator().manual_seed(0))
    local = shard(hidden, sizes, pg.tp).requires_grad_(True)
    logits, _ = layer(local, runtime_gather_output=SETUP["runtime_gather_output"])
    group = {"tp_group": pg.tp} if "tp_group" in inspect.signature(tensor_parallel.vocab_parallel_cross_entropy).parameters else {}
    loss = tensor_parallel.vocab_parallel_cross_entropy(
        logits.float().clone(), labels, label_smoothing=SETUP["label_smoothing"], **group).mean()
    loss.backward()
    grad_in = gather(local.grad, 0, pg.tp) if sizes["sp"] else local.grad
    return torch.cat([loss.detach().view(1), gather(layer.weight.grad, 0, pg.tp).flatten(),
                      grad_in.flatten()])
'''

ROUTER = '''
def run(sizes, pg):
    """TopKRouter forward and backward: [summed local_num_tokens, weight grad, input grad]."""
    def tokens(tensor):  # this rank's tokens: its CP chunk of the sequence, then its SP share
        return shard(tensor.chunk(pg.cp.size())[pg.cp.rank()], sizes, pg.tp)
    config = config_for(sizes, num_moe_experts=SETUP["experts"], moe_router_topk=SETUP["topk"],
                        moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="aux_loss",
                        add_bias_linear=False)
    router = TopKRouter(config, pg, **SETUP.get("model_args", {}))
    router.weight.data.copy_(seeded("router", SETUP["experts"], SETUP["hidden"]) * 0.05)
    seq, batch = SETUP["seq"], SETUP["batch"]
    local = tokens(seeded("tokens", seq, batch, SETUP["hidden"])).requires_grad_(True)
    padding = torch.zeros(seq, batch, dtype=torch.bool)  # True marks padding, uneven over ranks
    padding[seq * 5 // 8:, 0] = padding[seq - 1:, 1] = SETUP["padding"]
    counts = []  # the local token count megatron's router computes, recorded as it is returned

    def recorded(*args, **kwargs):
        result = counting(*args, **kwargs)
        counts.append(torch.as_tensor(result[1], dtype=torch.float32).clone())
        return result
    counting, router_module.get_tokens_per_expert_and_token_count = (
        router_module.get_tokens_per_expert_and_token_count, recorded)
    try:
        probs, _ = router(local, padding_mask=tokens(padding) if SETUP["padding"] else None)
    finally:
        router_module.get_tokens_per_expert_and_token_count = counting
    upstream = seeded("upstream", seq, batch, SETUP["experts"]).reshape(seq, -1)
    (probs * tokens(upstream).reshape(probs.shape)).sum().backward()
    dist.all_reduce(router.weight.grad, group=pg.cp)  # DDP's average over CP of a loss scaled by cp
    dist.all_reduce(router.weight.grad, group=pg.tp)  # finalize_model_grads' sequence-parallel sum
    count = torch.stack(counts).sum().view(1) if counts else torch.zeros(1)
    dist.all_reduce(count, group=pg.tp_cp)
    grad_in = gather(gather(local.grad, 0, pg.tp) if sizes["sp"] else local.grad, 0, pg.cp)
    return torch.cat([count, router.weight.grad.flatten(), grad_in.flatten()])
'''

TRAINING = '''
def train(sizes, pg, config, model, microbatches, seq, losses):
    """A training step on this rank's data-parallel share of the microbatches (all in the reference), ``losses(model,
    batch)`` giving per-token losses and mask: [the optimizer's gradient norm, the loss sum, every gradient's norm]."""
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    load_weights(model, pg)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model, pg_collection=pg)
    config.finalize_model_grads_func, config.no_sync_func = finalize_model_grads, ddp.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.5, clip_grad=SETUP.get("clip_grad", 1.0)),
                                       [ddp], use_gloo_process_groups=False, pg_collection=pg)
    def forward_step(data, model):  # megatron's: its loss function gives the masked sum, the count, a report
        output, mask = losses(model, next(data))
        def loss_function(out):
            loss_sum = (out.float().reshape(-1) * mask.reshape(-1).float()).sum()
            return loss_sum, mask.sum().to(torch.int), {"lm loss": loss_sum.detach().clone()}  # megatron divides loss_sum in place
        return output, loss_function
    mine = microbatches if sizes["whole_batch"] else microbatches[pg.dp.rank()::pg.dp.size()]
    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mine), model=[ddp], num_microbatches=len(mine),
        seq_length=seq, micro_batch_size=SETUP["micro_batch"], forward_only=False, pg_collection=pg,
        p2p_communicator=P2PCommunicator(pp_group=pg.pp, config=config))
    loss = torch.stack([report["lm loss"] for report in reports]).sum().view(1) if reports else torch.zeros(1)
    if not sizes["whole_batch"]:  # each data-parallel (and CP) rank holds its part of the batch
        dist.all_reduce(loss, group=pg.dp_cp)
    dist.all_reduce(loss, group=pg.pp)  # the last stage's
    norms = grad_norms(model, pg)
    _, grad_norm, _ = optimizer.step()
    counted = {id(grad) for chained in getattr(optimizer, "chained_optimizers", [optimizer])  # after the step
               for grad in (getattr(chained, "get_grads_for_grad_norm", None) or chained.get_main_grads_for_grad_norm)()}
    return torch.cat([torch.tensor([float(grad_norm)]), loss, norms, grad_norms(model, pg, counted)])
'''

GPT = '''
def batches(pg):
    """The microbatches, each cut for this rank's CP rank by megatron."""
    gen = torch.Generator().manual_seed(1000)
    shape = (SETUP["microbatches"], SETUP["micro_batch"], SETUP["seq"])
    tokens, labels = (torch.randint(0, SETUP["vocab"], shape, generator=gen) for _ in range(2))
    mask = (torch.rand(shape, generator=gen) < 0.6).float() if SETUP["loss_mask"] else torch.ones(shape)
    positions = torch.arange(SETUP["seq"]).expand(shape[1:]).contiguous()
    release = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}
    return [get_batch_on_this_cp_rank(dict(tokens=tokens[i], labels=labels[i], loss_mask=mask[i],
                                           position_ids=positions), cp_group=pg.cp, **release) for i in range(len(tokens))]


def run(sizes, pg):
    """One GPT training step through the schedules."""
    config = config_for(sizes, num_layers=SETUP["layers"], num_attention_heads=SETUP["heads"], mtp_num_layers=SETUP.get("mtp_layers"))
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm,
                                    normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
    if sizes["cp"] > 1:
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if config.mtp_num_layers else None
    model = GPTModel(config, spec, SETUP["vocab"], SETUP["seq"], pg_collection=pg,
                     pre_process=pg.pp.rank() == 0, post_process=pg.pp.rank() == pg.pp.size() - 1,
                     position_embedding_type=SETUP["position_embedding"], mtp_block_spec=mtp,
                     share_embeddings_and_output_weights=SETUP["share_embeddings"], **SETUP.get("model_args", {}))
    return train(sizes, pg, config, model, batches(pg), SETUP["seq"], lambda model, batch: (model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **SETUP.get("forward_args", {})), batch["loss_mask"]))
'''

T5 = '''
def batches():
    """The microbatches: encoder and decoder tokens, labels, the loss mask and megatron's
    attention masks (True = masked out; padded encoder positions masked for both attentions)."""
    gen = torch.Generator().manual_seed(2000)
    mb, b, enc, dec = SETUP["microbatches"], SETUP["micro_batch"], SETUP["encoder_seq"], SETUP["decoder_seq"]
    encoder_ids = torch.randint(0, SETUP["vocab"], (mb, b, enc), generator=gen)
    decoder_ids, labels = (torch.randint(0, SETUP["vocab"], (mb, b, dec), generator=gen) for _ in range(2))
    lengths = torch.randint(enc // 2, enc + 1, (mb, b), generator=gen) if SETUP["encoder_padding"] else torch.full((mb, b), enc)
    padded = (torch.arange(enc) >= lengths[..., None])[:, :, None, None, :]  # [mb, b, 1, 1, enc]
    causal = torch.ones(dec, dec, dtype=torch.bool).triu(1).expand(b, 1, dec, dec)
    mask = (torch.rand(mb, b, dec, generator=gen) < 0.6).float() if SETUP["loss_mask"] else torch.ones(mb, b, dec)
    return [dict(encoder_input_ids=encoder_ids[i], decoder_input_ids=decoder_ids[i], lm_labels=labels[i],
                 loss_mask=mask[i], encoder_attn_mask=padded[i].expand(b, 1, enc, enc), decoder_attn_mask=causal,
                 encoder_decoder_attn_mask=padded[i].expand(b, 1, dec, enc)) for i in range(mb)]


def run(sizes, pg):
    """One training step of a T5Model (local specs; the decoder cross-attends to the encoder
    output) through the schedules."""
    config = config_for(sizes, num_layers=SETUP["layers"], num_attention_heads=SETUP["heads"])
    model = T5Model(config=config, encoder_config=config, transformer_encoder_layer_spec=encoder_model_with_local_spec(),
                    transformer_decoder_layer_spec=decoder_model_with_local_spec(), vocab_size=SETUP["vocab"],
                    max_sequence_length=max(SETUP["encoder_seq"], SETUP["decoder_seq"]), pg_collection=pg,
                    share_embeddings_and_output_weights=SETUP["share_embeddings"],
                    position_embedding_type=SETUP["position_embedding"], **SETUP.get("model_args", {}))
    return train(sizes, pg, config, model, batches(), SETUP["decoder_seq"], lambda model, batch: (
        model(**{name: value for name, value in batch.items() if name != "loss_mask"},
              **SETUP.get("forward_args", {})), batch["loss_mask"]))
'''

MULTIMODAL = '''
def batches():
    """The microbatches: token ids with one image token per sample (none in the last one with
    text_only_sample), images, labels, loss mask and positions; text and image's embeddings
    make ``combined_seq`` tokens."""
    gen = torch.Generator().manual_seed(3000)
    b, size = SETUP["micro_batch"], SETUP["image_size"]
    text = SETUP["combined_seq"] + 1 - (size // SETUP["patch"]) ** 2 - SETUP["keep_class_token"]
    with_image = b - SETUP["text_only_sample"]
    microbatches = []
    for _ in range(SETUP["microbatches"]):
        ids, labels = (torch.randint(0, SETUP["vocab"], (b, text), generator=gen) for _ in range(2))
        ids[torch.arange(with_image), torch.randint(0, text, (with_image,), generator=gen)] = DEFAULT_IMAGE_TOKEN_INDEX
        mask = (torch.rand(b, text, generator=gen) < 0.6).float() if SETUP["loss_mask"] else torch.ones(b, text)
        microbatches.append(dict(input_ids=ids, labels=labels, loss_mask=mask,
                                 images=torch.randn(with_image, 3, size, size, generator=gen),
                                 position_ids=torch.arange(text).expand(b, text).contiguous()))
    return microbatches


def run(sizes, pg):
    """One training step of a LLaVAModel (a CLIP ViT, its projection, the image embeddings
    scattered into the text's) through the schedules; vision and projection run without SP."""
    language, vision, projection = (config_for({**sizes, "sp": sp}, num_layers=SETUP["layers"],
                                               num_attention_heads=SETUP["heads"])
                                    for sp in (sizes["sp"], False, False))
    vision.vision_model_type = "clip"
    model = LLaVAModel(
        language_transformer_config=language, language_transformer_layer_spec=get_gpt_layer_local_spec(),
        language_vocab_size=SETUP["vocab"], language_max_sequence_length=SETUP["combined_seq"],
        vision_transformer_config=vision, vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=not SETUP["keep_class_token"], vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=tensor_parallel.ColumnParallelLinear,
                                                   linear_fc2=tensor_parallel.RowParallelLinear),
        vision_projection_type=SETUP["projection"], img_h=SETUP["image_size"], img_w=SETUP["image_size"],
        patch_dim=SETUP["patch"], pg_collection=pg, **SETUP.get("model_args", {}))
    model.model_type = ModelType.encoder_or_decoder  # as Megatron-LM's get_model sets it
    # LLaVA returns the per-token losses and the loss mask, shifted with the image's positions
    return train(sizes, pg, language, model, batches(), SETUP["combined_seq"], lambda model, batch: model(
        batch["images"], batch["input_ids"], batch["position_ids"], None, labels=batch["labels"],
        loss_mask=batch["loss_mask"], **SETUP.get("forward_args", {})))
'''

CLIP_NORM = f"""
{harness_source(patches._with_default_norms)}


# Transformer Engine only: without TE, CLIP's default norms are torch LayerNorms, which cannot be
# built from a config; megatron's torch norm built from the config stands in for TE's norm
CLIPViTModel.__init__ = _with_default_norms(CLIPViTModel.__init__, WrappedTorchNorm)
"""

LLAVA_SP_ATTENTION = '''
# Transformer Engine only: LLaVA allows sequence parallelism with TE's attention only; here it is
# megatron's torch attention of the local spec (HAVE_TE is read only there and under cp)
llava_model.TEDotProductAttention, llava_model.HAVE_TE = DotProductAttention, True
'''

CP_ATTENTION = '''
class ContextParallelAttention(DotProductAttention):
    """Megatron's torch attention over keys and values gathered across CP (upstream it is TE only)."""

    def __init__(self, config, *args, **kwargs):
        plain = copy.copy(config)
        plain.context_parallel_size = 1
        super().__init__(plain, *args, **kwargs)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, *args, **kwargs):
        group = self.pg_collection.cp
        size, rank, n = group.size(), group.rank(), query.size(0)
        key, value = (gather_from_sequence_parallel_region(t, group=group) for t in (key, value))

        def positions(r):  # megatron's load-balanced order: rank r holds chunks r and 2*cp-1-r
            return torch.cat([torch.arange(r * n // 2, (r + 1) * n // 2),
                              torch.arange((2 * size - 1 - r) * n // 2, (2 * size - r) * n // 2)])
        mask = torch.cat([positions(r) for r in range(size)])[None, :] > positions(rank)[:, None]
        return super().forward(query, key, value, mask[None, None], attn_mask_type, *args, **kwargs)
'''

GDN = '''
def run(sizes, pg):
    """A GatedDeltaNet layer's forward and backward, then finalize_model_grads: the norm of every
    gradient (a replicated one on each rank: replicas must agree)."""
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = config_for(sizes, experimental_attention_variant="gated_delta_net", linear_attention_freq=1,
                        linear_conv_kernel_dim=SETUP["conv_kernel"], linear_key_head_dim=SETUP["head_dim"],
                        linear_value_head_dim=SETUP["head_dim"], linear_num_key_heads=SETUP["key_heads"],
                        linear_num_value_heads=SETUP["value_heads"], normalization="RMSNorm",
                        activation_func=torch.nn.functional.silu)
    layer = GatedDeltaNet(config, GatedDeltaNetSubmodules(
        in_proj=tensor_parallel.ColumnParallelLinear, out_norm=WrappedTorchNorm,
        out_proj=tensor_parallel.RowParallelLinear), layer_number=1, bias=SETUP["bias"],
        conv_bias=SETUP["conv_bias"], use_qk_l2norm=SETUP["use_qk_l2norm"], pg_collection=pg)
    load_weights(layer, pg)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), layer, pg_collection=pg)
    shape = (SETUP["seq"], SETUP["batch"], SETUP["hidden"])
    hidden = shard(seeded("hidden", *shape), sizes, pg.tp).requires_grad_(True)
    output, _ = layer(hidden, attention_mask=None)
    (output * shard(seeded("upstream", *shape), sizes, pg.tp)).sum().backward()
    finalize_model_grads([ddp], pg_collection=pg)
    return grad_norms(layer, pg)
'''

CAUSAL_CONV1D = f"""
# CUDA-only kernels (causal_conv1d, mamba_ssm, FLA): shardcheck's plain torch (cpu/kernels.py)
{harness_source(kernels._refuse, kernels.causal_conv1d_fn)}
"""

MAMBA = '''
def run(sizes, pg):
    """A Mamba-2 mixer's forward and backward, then finalize_model_grads: the norm of every gradient."""
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = config_for(sizes, mamba_state_dim=SETUP["state_dim"], mamba_head_dim=SETUP["head_dim"],
                        mamba_num_groups=SETUP["groups"])
    layer = mamba_module.MambaMixer(config, mamba_module.MambaMixerSubmodules(
        in_proj=tensor_parallel.ColumnParallelLinear, out_proj=tensor_parallel.RowParallelLinear),
        d_model=SETUP["hidden"], d_conv=SETUP["conv_kernel"], expand=SETUP["expand"],
        D_has_hdim=SETUP["d_has_hdim"], rmsnorm=SETUP["rmsnorm"], conv_bias=SETUP["conv_bias"],
        layer_number=1, pg_collection=pg)
    load_weights(layer, pg)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), layer, pg_collection=pg)
    shape = (SETUP["seq"], SETUP["batch"], SETUP["hidden"])
    hidden = tokens(seeded("hidden", *shape), sizes, pg).requires_grad_(True)
    output, _ = layer(hidden)
    # as megatron's schedules: DDP sums a per-token loss over dp x cp, else averages it (scaled by cp)
    scale = 1 / pg.dp.size() if config.calculate_per_token_loss else pg.cp.size()
    ((output * tokens(seeded("upstream", *shape), sizes, pg)).sum() * scale).backward()
    finalize_model_grads([ddp], pg_collection=pg)
    return grad_norms(layer, pg)


def tokens(tensor, sizes, pg):
    """This rank's part of a global [seq, ...] tensor: its CP chunks in megatron's load-balanced
    order (r and 2*cp-1-r of 2*cp), then its share under sequence parallelism."""
    chunks = tensor.chunk(2 * pg.cp.size())
    return shard(torch.cat([chunks[pg.cp.rank()], chunks[-1 - pg.cp.rank()]]), sizes, pg.tp)
'''

MAMBA_KERNELS = f"""
{harness_source(kernels.mamba_chunk_scan_combined, kernels.mamba_split_conv1d_scan_combined,
                kernels.RMSNormGated)}


TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"
# Triton-only: inference helpers that mamba_mixer imports at module level (training never calls them)
sys.modules[TENSOR_OPS] = types.SimpleNamespace(tensor_get_slice_after=None, tensor_masked_update=None,
                                                tensor_merge=None)
mamba_module = importlib.import_module("megatron.core.ssm.mamba_mixer")
vars(mamba_module).update(causal_conv1d_fn=causal_conv1d_fn, mamba_chunk_scan_combined=mamba_chunk_scan_combined,
                          mamba_split_conv1d_scan_combined=mamba_split_conv1d_scan_combined,
                          ExtendedRMSNorm=RMSNormGated, RMSNormGated=RMSNormGated, HAVE_MAMBA_SSM=True)
"""

GDN_KERNELS = f"""
{harness_source(kernels.causal_conv1d, kernels.l2norm, kernels.chunk_gated_delta_rule)}


# set where GatedDeltaNet's code reads them (gated_delta_net.py; 0.19: gated_delta_net/*.py)
for gdn_home in {{sys.modules[c.__module__] for c in gdn_module.GatedDeltaNet.__mro__ if "ssm" in c.__module__}}:
    vars(gdn_home).update(chunk_gated_delta_rule=chunk_gated_delta_rule, HAVE_FLA=True, l2norm=l2norm,
                          causal_conv1d_fn=causal_conv1d_fn, causal_conv1d=causal_conv1d)
torch._dynamo.config.disable = True  # megatron's jit_fuser would build C++ kernels on each rank
"""

NORM_UNDER_SP = f"""
{harness_source(patches._norm_with_sequence_parallel)}


# Transformer Engine only: megatron's torch norm refuses sequence parallelism; it is built without,
# its parameters marked for finalize_model_grads' tp sum, as TE's norms are (cpu/patches.py)
WrappedTorchNorm.__new__ = _norm_with_sequence_parallel(WrappedTorchNorm.__new__)
"""

PATCH_RNG = '''
# CUDA-only: megatron's RNG tracker keeps CUDA generator states; point it at the CPU generator
torch.cuda.get_rng_state = tensor_parallel.random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
torch.cuda.set_rng_state = tensor_parallel.random._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
torch.cuda.manual_seed = torch.manual_seed
'''

PATCH_DEVICE = '''
torch.cuda.current_device = lambda: "cpu"  # CUDA-only: megatron puts tensors on the current device
'''

PATCH_SYNCHRONIZE = '''
torch.cuda.synchronize = lambda *a, **k: None  # CUDA-only: pipeline send/recv waits for the device
'''

PATCH_CUDA_TENSORS = '''
class CudaToCpu(TorchFunctionMode):
    """CUDA-only: tensors the schedules, DDP and the optimizer make on "cuda" are made on the CPU
    (and a tensor's type() reads as the CUDA type that gradient clipping asserts)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.")
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


CudaToCpu().__enter__()
'''

PATCH_STREAMS = '''
# CUDA-only: the streams and events DDP's gradient sync (0.19) and the MoE dispatcher wait on do nothing
CpuStream = type("CpuStream", (contextlib.nullcontext,), {"__getattr__": lambda self, name: lambda *a, **k: self})
torch.cuda.Stream = torch.cuda.Event = torch.cuda.stream = torch.cuda.current_stream = lambda *a, **k: CpuStream()
'''

ALLTOALL_ON_CPU = f"""
{harness_source(patches._to_host)}


# CUDA-only: the dispatcher's split sizes read on the host, as numpy like a device tensor's copy
moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = _to_host(
    moe_utils.maybe_move_tensor_to_cpu)
"""

PATCH_TE_GEMM = '''
# CUDA-only: the router tests Transformer Engine's gemm for None, but it is unset without TE
moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
'''

CONTRACT_FIX = '''
FIXED = "--fixed" in sys.argv[1:]  # run everything with the corrected function below
_ORIGINALS = {{{name!r}: importlib.import_module({module!r}).{attribute}}}


{source}


def with_fix(sizes, on):
    """``sizes``; every megatron-core reference to {attribute} calls {fix} when ``on``."""
    original = _ORIGINALS[{name!r}]
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("megatron") and \\
                getattr(module, {attribute!r}, None) in (original, {fix}):
            setattr(module, {attribute!r}, {fix} if on else original)
    return sizes
'''

GROUPS_FIX = '''
FIXED = "--fixed" in sys.argv[1:]  # run everything with the fix: parallel_state on the model's groups


def with_fix(sizes, on):
    """``sizes``; when ``on``, with parallel_state's global groups those the model is given, so
    code that reads the globals instead of the model's pg_collection gets the right ones."""
    return {**sizes, "order": sizes["model_order"]} if on else sizes
'''

ENTRY_POINTS = '''
def observed():
    return run_on(SIZES, check=True)


def reference():
    return run_on(ONE_RANK)
'''

FIXED_ENTRY_POINTS = '''
def observed():
    return run_on(with_fix(SIZES, FIXED), check=True)


def reference():
    return run_on(with_fix(ONE_RANK, FIXED))


def corrected():
    return run_on(with_fix(SIZES, True))
'''
