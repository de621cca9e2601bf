"""Per-component code of the audit's repro scripts: real megatron-core calls, one-rank reference.

A template turns a finding's component, options and layout into the ``observed()`` /
``reference()`` / ``corrected()`` code that :func:`shardcheck.repro.render_script` wraps into a
self-contained torchrun script. ``run_on(sizes)`` builds Megatron's process groups for a
layout with ``initialize_model_parallel``, then the component's ``run(sizes)`` returns its global
values on every rank; the reference is the same ``run`` with tp = cp = 1 (every rank computes it
on full tensors). The observed run goes through shardcheck's type checker when the script finds
shardcheck installed (:mod:`shardcheck.megatron.repro_check`), for the ``checker:`` line.
When the finding's contract carries a fix, its source is inlined, ``corrected()`` reruns the
layout with it patched into megatron-core, and ``--fixed`` runs the whole script with it (the
script then exits 1: what a fixed release gives). Only the CUDA-only pieces a path needs are
patched, inline.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from shardcheck.findings import Finding
from shardcheck.layout import Layout
from shardcheck.megatron.contracts import BY_NAME, Contract
from shardcheck.repro import ReproError, ScriptBody

_HELPERS = '''
def run_on(sizes, check=False):
    """``run`` on megatron's process groups for ``sizes`` (data parallelism takes the rest of the
    world); with ``check``, under shardcheck's type checker when it is installed."""
    global CHECKER
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(sizes["tp"], sizes["pp"], context_parallel_size=sizes["cp"],
                                 expert_model_parallel_size=sizes["ep"])
    if check and CHECKER:
        try:  # optional, only for the checker: line
            from shardcheck.megatron.repro_check import checked_run
        except ImportError:
            CHECKER = None  # no checker here to confirm the line the audit recorded
        else:
            result, CHECKER = checked_run(run, sizes, CHECKER)
            return result
    return run(sizes)


def config_for(sizes, **options):
    """A CPU-runnable TransformerConfig for ``sizes`` with the component's and finding's options."""
    return TransformerConfig(**{
        "num_layers": 1, "hidden_size": SETUP["hidden"], "num_attention_heads": 4,
        "use_cpu_initialization": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "tensor_model_parallel_size": sizes["tp"], "context_parallel_size": sizes["cp"],
        "sequence_parallel": sizes["sp"], "pipeline_dtype": torch.float32,
        "gradient_accumulation_fusion": False, "bias_activation_fusion": False,
        "masked_softmax_fusion": False, "apply_rope_fusion": False, **options, **OVERRIDES})
'''

_PIECES = '''
def gather(tensor, dim, group):
    """The global tensor from each rank's piece along ``dim`` over ``group``."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def shard(tensor, sizes):
    """This rank's sequence chunk (dim 0) under sequence parallelism, else the whole tensor."""
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return tensor.chunk(tp)[rank] if sizes["sp"] else tensor


def seeded(key, *shape):
    """A global tensor that depends only on ``key`` and its shape: the same in every layout."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))
'''

_OUTPUT_LOSS = '''
def run(sizes):
    """ColumnParallelLinear logits into vocab_parallel_cross_entropy: [loss, weight grad, input grad]."""
    tp, rank, group = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                       ps.get_tensor_model_parallel_group())
    config = config_for(sizes)
    layer = tensor_parallel.ColumnParallelLinear(
        SETUP["hidden"], SETUP["vocab"], config=config, init_method=config.init_method, bias=False,
        gather_output=not SETUP["parallel_output"])
    layer.weight.data.copy_(seeded("weight", SETUP["vocab"], SETUP["hidden"]).chunk(tp)[rank] * 0.05)
    hidden = seeded("hidden", SETUP["seq"], SETUP["batch"], SETUP["hidden"])
    labels = torch.randint(0, SETUP["vocab"], (SETUP["seq"], SETUP["batch"]),
                           generator=torch.Generator().manual_seed(0))
    local = shard(hidden, sizes).requires_grad_(True)
    logits, _ = layer(local, runtime_gather_output=SETUP["runtime_gather_output"])
    loss = tensor_parallel.vocab_parallel_cross_entropy(
        logits.float().clone(), labels, label_smoothing=SETUP["label_smoothing"]).mean()
    loss.backward()
    grad_in = gather(local.grad, 0, group) if sizes["sp"] else local.grad
    return torch.cat([loss.detach().view(1), gather(layer.weight.grad, 0, group).flatten(),
                      grad_in.flatten()])
'''

_ROUTER = '''
def run(sizes):
    """TopKRouter forward and backward: [summed local_num_tokens, weight grad, input grad]."""
    group, cp_group = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()

    def tokens(tensor):  # this rank's tokens: its CP chunk of the sequence, then its SP share
        return shard(tensor.chunk(sizes["cp"])[ps.get_context_parallel_rank()], sizes)
    config = config_for(sizes, num_moe_experts=SETUP["experts"], moe_router_topk=SETUP["topk"],
                        moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="aux_loss",
                        add_bias_linear=False, expert_model_parallel_size=sizes["ep"])
    router = TopKRouter(config, ProcessGroupCollection.use_mpu_process_groups())
    router.weight.data.copy_(seeded("router", SETUP["experts"], SETUP["hidden"]) * 0.05)
    seq, batch = SETUP["seq"], SETUP["batch"]
    hidden = seeded("tokens", seq, batch, SETUP["hidden"])
    local = tokens(hidden).requires_grad_(True)
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
        mask = tokens(padding) if SETUP["padding"] else None
        probs, _ = router(local, padding_mask=mask)
    finally:
        router_module.get_tokens_per_expert_and_token_count = counting
    upstream = seeded("upstream", seq, batch, SETUP["experts"]).reshape(seq, -1)
    (probs * tokens(upstream).reshape(probs.shape)).sum().backward()
    dist.all_reduce(router.weight.grad, group=cp_group)  # DDP's average over CP of a loss scaled by cp
    dist.all_reduce(router.weight.grad, group=group)  # finalize_model_grads' sequence-parallel sum
    count = torch.stack(counts).sum().view(1) if counts else torch.zeros(1)
    dist.all_reduce(count, group=ps.get_tensor_and_context_parallel_group())
    grad_in = gather(gather(local.grad, 0, group) if sizes["sp"] else local.grad, 0, cp_group)
    return torch.cat([count, router.weight.grad.flatten(), grad_in.flatten()])
'''

_GPT = '''
def masked_loss(mask, output):
    """Megatron's training loss function: (sum of masked losses, token count, report)."""
    mask = mask.reshape(-1).float()
    loss_sum = (output.float().reshape(-1) * mask).sum()
    return loss_sum, mask.sum().to(torch.int), {"lm loss": loss_sum.detach()}


def batches(sizes):
    """This rank's microbatches: its data-parallel share, cut for its CP rank by megatron."""
    gen = torch.Generator().manual_seed(1000)
    shape = (SETUP["microbatches"], SETUP["micro_batch"], SETUP["seq"])
    tokens, labels = (torch.randint(0, SETUP["vocab"], shape, generator=gen) for _ in range(2))
    mask = (torch.rand(shape, generator=gen) < 0.6).float() if SETUP["loss_mask"] else torch.ones(shape)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = range(dp_rank * len(tokens) // dp, (dp_rank + 1) * len(tokens) // dp)
    positions = torch.arange(SETUP["seq"]).expand(shape[1:]).contiguous()
    return [get_batch_on_this_cp_rank(dict(tokens=tokens[i], labels=labels[i], loss_mask=mask[i],
                                           position_ids=positions)) for i in share]


def forward_step(data, model):
    batch = next(data)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, lambda out: masked_loss(batch["loss_mask"], out)


def run(sizes):
    """One GPT training step through the schedules: the norm of every gradient after finalize."""
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = config_for(sizes, num_layers=SETUP["layers"], hidden_size=SETUP["hidden"],
                        num_attention_heads=SETUP["heads"])
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm,
                                    normalization=config.normalization, qk_l2_norm=config.qk_l2_norm)
    if sizes["cp"] > 1:
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    model = GPTModel(config, spec, SETUP["vocab"], SETUP["seq"], position_embedding_type=SETUP[
        "position_embedding"], share_embeddings_and_output_weights=SETUP["share_embeddings"])
    for name, param in model.named_parameters():  # the same weights in every layout (tp = 1)
        param.data.copy_(WEIGHTS.setdefault(name, param.data.clone()))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func, config.no_sync_func = finalize_model_grads, ddp.no_sync
    mine = batches(sizes)
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mine), model=[ddp],
                                num_microbatches=len(mine), seq_length=SETUP["seq"],
                                micro_batch_size=SETUP["micro_batch"], forward_only=False)
    return torch.stack([param.main_grad.norm() for param in model.parameters()])


WEIGHTS = {}
'''

_CP_ATTENTION = '''
class ContextParallelAttention(DotProductAttention):
    """Megatron's torch attention over keys and values gathered across CP (upstream it is TE only)."""

    def __init__(self, config, *args, **kwargs):
        plain = copy.copy(config)
        plain.context_parallel_size = 1
        super().__init__(plain, *args, **kwargs)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, *args, **kwargs):
        group = ps.get_context_parallel_group()
        size, rank, n = dist.get_world_size(group), dist.get_rank(group), query.size(0)
        key, value = (gather_from_sequence_parallel_region(t, group=group) for t in (key, value))

        def positions(r):  # megatron's load-balanced order: rank r holds chunks r and 2*cp-1-r
            return torch.cat([torch.arange(r * n // 2, (r + 1) * n // 2),
                              torch.arange((2 * size - 1 - r) * n // 2, (2 * size - r) * n // 2)])
        mask = torch.cat([positions(r) for r in range(size)])[None, :] > positions(rank)[:, None]
        return super().forward(query, key, value, mask[None, None], attn_mask_type, *args, **kwargs)
'''

_GPT_IMPORTS = '''\
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.utils import get_batch_on_this_cp_rank'''

_CP_IMPORTS = '''\
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention'''

_ROUTER_IMPORTS = '''\
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import router as router_module
from megatron.core.transformer.moe.router import TopKRouter'''

_PATCH_RNG = '''
# CUDA-only: megatron's RNG tracker keeps CUDA generator states; point it at the CPU generator
torch.cuda.get_rng_state = tensor_parallel.random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
torch.cuda.set_rng_state = tensor_parallel.random._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
torch.cuda.manual_seed = torch.manual_seed
'''

_PATCH_DEVICE = '''
torch.cuda.current_device = lambda: "cpu"  # CUDA-only: megatron puts tensors on the current device
'''

_PATCH_CUDA_TENSORS = '''
class CudaToCpu(TorchFunctionMode):
    """CUDA-only: tensors the schedules and DDP hard-code on "cuda" are made on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


CudaToCpu().__enter__()
'''

_PATCH_TE_GEMM = '''
# CUDA-only: the router tests Transformer Engine's gemm for None, but it is unset without TE
moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
'''


@dataclasses.dataclass(frozen=True)
class Snippet:
    """A piece of script code and the imports it needs."""

    code: str
    imports: str = ""


BASE = Snippet(_HELPERS, """\
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig""")
TENSORS = Snippet(_PIECES, "import zlib")
RNG_ON_CPU = Snippet(_PATCH_RNG)
DEVICE_ON_CPU = Snippet(_PATCH_DEVICE)
CUDA_TENSORS_ON_CPU = Snippet(_PATCH_CUDA_TENSORS, "from torch.overrides import TorchFunctionMode")
TE_GEMM_UNSET = Snippet(_PATCH_TE_GEMM, "from megatron.core.transformer.moe import moe_utils")
CP_ATTENTION = Snippet(_CP_ATTENTION, _CP_IMPORTS + "\nimport copy")
FIX_IMPORTS = "import importlib\nimport inspect\nfrom contextlib import contextmanager"


@dataclasses.dataclass(frozen=True)
class Template:
    """One component's script: its setup dataclass, the snippets before its code, layout limits."""

    setup: str  # "module:Class" of the component's setup dataclass
    code: Snippet
    before: tuple[Snippet, ...] = ()
    refuses: Callable[[Layout], str | None] = lambda layout: None
    cp_attention: bool = False  # whether its model runs attention, which needs a CP stand-in


def _gpt_refuses(layout: Layout) -> str | None:
    if layout.tp > 1 or layout.pp > 1 or layout.ep > 1:
        return "the gpt template runs layouts with unsharded weights and one stage (tp = pp = ep = 1)"
    return None


def _router_refuses(layout: Layout) -> str | None:
    if layout.tp > 1 and not layout.sp:
        return "MoE with tp > 1 needs sequence parallelism (Megatron refuses it)"
    return None


TEMPLATES: dict[str, Template] = {
    "output_loss": Template("shardcheck.megatron.scenarios.output_loss:OutputLossSetup",
                            Snippet(_OUTPUT_LOSS), (DEVICE_ON_CPU, BASE, TENSORS)),
    "moe_router": Template("shardcheck.megatron.scenarios.moe_router:RouterSetup",
                           Snippet(_ROUTER, _ROUTER_IMPORTS),
                           (DEVICE_ON_CPU, TE_GEMM_UNSET, BASE, TENSORS), _router_refuses),
    "gpt": Template("shardcheck.megatron.scenarios.gpt:GPTSetup", Snippet(_GPT, _GPT_IMPORTS),
                    (RNG_ON_CPU, DEVICE_ON_CPU, CUDA_TENSORS_ON_CPU, BASE), _gpt_refuses,
                    cp_attention=True),
}


def contract_of(finding: Finding) -> Contract | None:
    """The contract a finding breaks, when it is one of the catalogue's."""
    return BY_NAME.get(finding.contract.split(":", 1)[0])


def script_body(finding: Finding) -> ScriptBody:
    """The script code of an audit finding, from its component's template; ReproError if none."""
    template = TEMPLATES.get(finding.target)
    if template is None:
        raise ReproError(f"no repro template for component {finding.target!r} yet "
                         f"(templates: {', '.join(sorted(TEMPLATES))})")
    layout = Layout.parse(finding.layout)
    if why := template.refuses(layout):
        raise ReproError(f"{why}; finding {finding.id} needs {finding.layout}")
    setup, overrides = _split_options(template.setup, finding.config)
    contract = contract_of(finding)
    fix = contract if contract is not None and contract.fix is not None else None
    constants = Snippet(f"SETUP = {setup!r}\nOVERRIDES = {overrides!r}  # TransformerConfig options\n"
                        f"SIZES = {_sizes(layout)!r}\nONE_RANK = {_sizes(Layout())!r}\n")
    cp_attention = [CP_ATTENTION] if layout.cp > 1 and template.cp_attention else []
    snippets = [constants, *template.before, *cp_attention, template.code]
    if fix is not None:
        snippets.append(Snippet(_fix_code(fix), FIX_IMPORTS))
    snippets.append(Snippet(_entry_points(fix is not None)))
    return ScriptBody(code="\n\n\n".join(s.code.strip("\n") for s in snippets),
                      imports=_sorted_imports(s.imports for s in snippets),
                      has_corrected=fix is not None)


def _sorted_imports(parts) -> str:
    lines = {line for part in parts for line in part.splitlines() if line.strip()}
    return "\n".join(sorted(lines, key=lambda line: (line.startswith("from"), line)))


def _sizes(layout: Layout) -> dict[str, Any]:
    return {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "ep": layout.ep, "sp": layout.sp}


def _split_options(setup_path: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The setup's fields (defaults with the options applied) and the TransformerConfig overrides."""
    import importlib

    module, name = setup_path.split(":")
    setup_cls = getattr(importlib.import_module(module), name)
    fields = {f.name: f.default for f in dataclasses.fields(setup_cls)
              if f.name != "config" and f.default is not dataclasses.MISSING}
    setup = {**fields, **{k: v for k, v in options.items() if k in fields}}
    overrides = {k: v for k, v in options.items() if k not in fields}
    if overrides and not any(f.name == "config" for f in dataclasses.fields(setup_cls)):
        raise ReproError(f"{name} has no options {sorted(overrides)}")
    return setup, overrides


def _fix_code(contract: Contract) -> str:
    """The contract's corrected function, inlined, and the patch routing megatron's calls to it."""
    source = textwrap.dedent(inspect.getsource(contract.fix))
    module, attribute = contract.function.split(":")
    return f'''
FIXED = "--fixed" in sys.argv[1:]  # run everything with the corrected function below
_ORIGINALS = {{{contract.name!r}: importlib.import_module({module!r}).{attribute}}}


{source.strip()}


@contextmanager
def fixed_megatron(on):
    """Route every megatron-core reference to {attribute} through the corrected function."""
    original = _ORIGINALS[{contract.name!r}]
    modules = [m for m in list(sys.modules.values()) if on and m.__name__.startswith("megatron")
               and getattr(m, {attribute!r}, None) is original]
    for module in modules:
        setattr(module, {attribute!r}, {contract.fix.__name__})
    yield
    for module in modules:
        setattr(module, {attribute!r}, original)
'''


def _entry_points(has_fix: bool) -> str:
    if not has_fix:
        return '''
def observed():
    return run_on(SIZES, check=True)


def reference():
    return run_on(ONE_RANK)
'''
    return '''
def observed():
    with fixed_megatron(FIXED):
        return run_on(SIZES, check=True)


def reference():
    with fixed_megatron(FIXED):
        return run_on(ONE_RANK)


def corrected():
    with fixed_megatron(True):
        return run_on(SIZES)
'''
