"""The code of the audit's repro scripts: the parts' modules read as script code, and the lines
that put the harness's CPU stand-ins in place.

:mod:`shardcheck.megatron.repro.templates` picks the pieces a finding needs and puts them
together; each is plain script code, run by ``torchrun`` without shardcheck. A script's own
code (its helpers, each component's ``run(sizes, pg)``, its entry points) lives in the modules of
:mod:`shardcheck.megatron.repro.parts`, read with :func:`part_source`. The CPU stand-ins of
CUDA-only code are the harness's own (:mod:`shardcheck.megatron.cpu`), their source read with
:func:`harness_source`, so a script runs the kernels and patches the audit ran; the constants
here are the statements that install them in a script.
"""

import ast
import inspect
import itertools
import textwrap
from pathlib import Path

from shardcheck.megatron.cpu import kernels, patches


def harness_source(*objects: object) -> str:
    """The source of the harness's ``objects`` (functions, classes) as a script defines them:
    their code as it is, without their docstrings (documented where they live)."""
    return "\n\n\n".join(without_docstrings(textwrap.dedent(inspect.getsource(obj)).strip())
                          for obj in objects)


# the imports every script starts with (shardcheck.fuzz.repro's template)
SCRIPT_HEADER = frozenset({"from __future__ import annotations", "import torch", "import torch.distributed as dist"})


PARTS = Path(__file__).parent / "parts"


def part_source(name: str) -> tuple[str, str]:
    """The module ``name`` of :mod:`shardcheck.megatron.repro.parts` as script code, read, not
    imported (a part imports megatron-core modules a release may lack): its imports, one per line
    (but shardcheck's, which name what the script defines itself, and those every script has),
    and the code after them."""
    source = (PARTS / f"{name}.py").read_text()
    body = ast.parse(source).body
    if body and ast.get_docstring(ast.Module(body=body[:1], type_ignores=[])) is not None:
        body = body[1:]
    imports = list(itertools.takewhile(lambda node: isinstance(node, (ast.Import, ast.ImportFrom)), body))
    lines = [ast.unparse(node) for node in imports
             if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardcheck"))]
    code = "\n".join(source.splitlines()[imports[-1].end_lineno if imports else body[0].lineno - 1:])
    return "\n".join(line for line in lines if line not in SCRIPT_HEADER), code.strip("\n")


def without_docstrings(source: str) -> str:
    """``source`` without the lines of its functions' and classes' docstrings."""
    docstrings = {line for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and len(node.body) > 1
                  and ast.get_docstring(node) is not None
                  for line in range(node.body[0].lineno, node.body[0].end_lineno + 1)}
    return "\n".join(line for number, line in enumerate(source.splitlines(), 1) if number not in docstrings)


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

CAUSAL_CONV1D = f"""
# CUDA-only kernels (causal_conv1d, mamba_ssm, FLA): shardcheck's plain torch (cpu/kernels.py)
{harness_source(kernels._refuse, kernels.causal_conv1d_fn)}
"""

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

PATCH_RECOMPUTE = '''
def _under_cpu_mode(backward):
    def rerun(ctx, *grads):
        with CudaToCpu():
            return backward(ctx, *grads)
    return staticmethod(rerun)


# CUDA-only: a checkpoint's backward reruns forward code, without the mode entered above
for _function in list(vars(tensor_parallel.random).values()):
    if isinstance(_function, type) and issubclass(_function, torch.autograd.Function) and "backward" in vars(_function):
        _function.backward = _under_cpu_mode(_function.backward)
'''

PATCH_DEVICE = '''
torch.cuda.current_device = lambda: "cpu"  # CUDA-only: megatron puts tensors on the current device
'''

PATCH_SYNCHRONIZE = '''
torch.cuda.synchronize = lambda *a, **k: None  # CUDA-only: pipeline send/recv waits for the device
'''

PATCH_CUDA_TENSORS = '''
class CudaToCpu(TorchFunctionMode):
    """CUDA-only: what Megatron makes on "cuda" or pinned is on the CPU; type() reads as CUDA's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.")
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)  # rotary positions' CP slice (rope_utils) pins its index
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


{fix}.__wrapped__ = _ORIGINALS[{name!r}]  # it takes the original's arguments: a probe binds them by its signature


def with_fix(sizes, on):
    """``sizes``; every megatron-core reference to {attribute} calls {fix} when ``on``."""
    original = _ORIGINALS[{name!r}]
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("megatron") and \\
                getattr(module, {attribute!r}, None) in (original, {fix}):
            setattr(module, {attribute!r}, {fix} if on else original)
    return sizes
'''

