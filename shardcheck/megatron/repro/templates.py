"""Per-component templates of the audit's repro scripts: real megatron-core calls, one-rank reference.

A template turns a finding's component, options and layout into the ``observed()`` /
``reference()`` / ``corrected()`` code that :func:`shardcheck.fuzz.repro.render_script` wraps into a
self-contained torchrun script, from the modules of :mod:`shardcheck.megatron.repro.parts` and
the CPU stand-ins of :mod:`shardcheck.megatron.repro.snippets`.
``run_on(sizes)`` builds Megatron's process groups for a layout with
``initialize_model_parallel`` (and, for a layout with explicit groups, the model's own
``ProcessGroupCollection`` in another rank order), then the component's ``run(sizes, pg)``
returns its global values on every rank; the reference is the same ``run`` with every
dimension but data parallelism at 1 (each rank computes the whole problem). The observed run
goes through shardcheck's type checker when the script finds shardcheck installed
(:mod:`shardcheck.megatron.repro.check`), for the ``checker:`` line. When the finding has a
fix (its contract's corrected function, or the model's groups for a global-group finding),
``corrected()`` reruns the layout with it and ``--fixed`` runs the whole script with it (the
script then exits 1: what a fixed release gives). Only the CUDA-only pieces a path needs are
patched, inline.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from collections.abc import Callable
from typing import Any

from shardcheck.fuzz.findings import Finding
from shardcheck.fuzz.repro import ReproError, ScriptBody
from shardcheck.megatron.audit.findings import ONE_RANK_CRASH, REPAIRED
from shardcheck.megatron.audit.report import GLOBAL_GROUP_CONTRACT
from shardcheck.megatron.audit.sweep import setup_kwargs
from shardcheck.megatron.checks import piece_gradients
from shardcheck.megatron.checks.contracts import BY_NAME, Contract
from shardcheck.megatron.checks.explicit import CONSTRUCTED
from shardcheck.megatron.repro import snippets as code
from shardcheck.megatron.scenarios import COMPONENTS
from shardcheck.parity.layout import DEFAULT_ORDER, Layout


@dataclasses.dataclass(frozen=True)
class Snippet:
    """A piece of script code and the imports it needs."""

    code: str
    imports: str = ""

    @classmethod
    def of(cls, part: str) -> Snippet:
        """The module ``part`` of :mod:`shardcheck.megatron.repro.parts` as script code."""
        imports, source = code.part_source(part)
        return cls(source, imports)


BASE = Snippet.of("base")
SEEDED = Snippet.of("seeded")
PIECES = Snippet.of("pieces")
SHARD = Snippet.of("shard")
WEIGHTS = Snippet.of("weights")
RNG_ON_CPU = Snippet(code.PATCH_RNG, "from megatron.core import tensor_parallel")
RECOMPUTE_ON_CPU = Snippet(code.PATCH_RECOMPUTE, "from megatron.core import tensor_parallel")
DEVICE_ON_CPU = Snippet(code.PATCH_DEVICE)
NO_SYNCHRONIZE = Snippet(code.PATCH_SYNCHRONIZE)
STREAMS_ON_CPU = Snippet(code.PATCH_STREAMS, "import contextlib")
CUDA_TENSORS_ON_CPU = Snippet(code.PATCH_CUDA_TENSORS, "from torch.overrides import TorchFunctionMode")
TE_GEMM_UNSET = Snippet(code.PATCH_TE_GEMM, "from megatron.core.transformer.moe import moe_utils")
CAUSAL_CONV1D = Snippet(code.CAUSAL_CONV1D, "import torch.nn.functional as F")
MAMBA_KERNELS = Snippet(code.MAMBA_KERNELS, "import importlib\nimport math\nimport types")
GDN_KERNELS = Snippet(code.GDN_KERNELS, "import torch._dynamo\nfrom megatron.core.ssm import gated_delta_net as gdn_module")
CP_ATTENTION = Snippet.of("cp_attention")
TRAINING = Snippet.of("training")
MOE_METRICS = Snippet.of("moe_metrics")
GPT_CODE = Snippet.of("gpt")
LOCAL_SPEC = Snippet.of("local_spec")
MLA_SPEC = Snippet.of("mla_spec")
T5_CODE = Snippet.of("t5")
MULTIMODAL_CODE = Snippet.of("multimodal")
CLIP_NORM = Snippet(code.CLIP_NORM, """\
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.transformer.torch_norm import WrappedTorchNorm""")
LLAVA_SP_ATTENTION = Snippet(code.LLAVA_SP_ATTENTION, """\
from megatron.core.models.multimodal import llava_model
from megatron.core.transformer.dot_product_attention import DotProductAttention""")
GDN_CODE = Snippet.of("gdn")
MAMBA_CODE = Snippet.of("mamba")
NORM_UNDER_SP = Snippet(code.NORM_UNDER_SP, """\
import copy
from megatron.core.transformer.torch_norm import WrappedTorchNorm""")
ALLTOALL_ON_CPU = Snippet(code.ALLTOALL_ON_CPU, """\
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import token_dispatcher""")
ROUTER_CODE = Snippet.of("router")


def _gpt_sections(setup: dict[str, Any], overrides: dict[str, Any]) -> dict[str, list[int]]:
    """GLU's fused fc1 holds two sections, each cut over tp."""
    if not overrides.get("gated_linear_unit"):
        return {}
    ffn = overrides.get("ffn_hidden_size") or 4 * setup["hidden"]
    return {"linear_fc1.weight": [ffn, ffn], "linear_fc1.bias": [ffn, ffn]}


def _gdn_sections(setup: dict[str, Any], overrides: dict[str, Any]) -> dict[str, list[int]]:
    """in_proj holds query, key, value, gate, beta and alpha; conv1d query, key and value."""
    qk, v = setup["key_heads"] * setup["head_dim"], setup["value_heads"] * setup["head_dim"]
    heads = setup["value_heads"]
    return {"in_proj.weight": [qk, qk, v, v, heads, heads], "conv1d.weight": [qk, qk, v],
            "conv1d.bias": [qk, qk, v]}


def _mamba_sections(setup: dict[str, Any], overrides: dict[str, Any]) -> dict[str, list[int]]:
    """in_proj holds z, x, B, C and dt; the convolution x, B and C (its weight and bias are
    ``conv1d.weight`` and ``conv1d.bias`` in 0.16, the mixer's own ``conv1d_weight`` and
    ``conv1d_bias`` in 0.19: the script runs on either)."""
    heads = overrides.get("mamba_num_heads") or setup["expand"] * setup["hidden"] // setup["head_dim"]
    inner, state = heads * setup["head_dim"], setup["groups"] * setup["state_dim"]
    conv = [inner, state, state]
    return {"in_proj.weight": [inner, inner, state, state, heads],
            **{f"conv1d{sep}{part}": conv for sep in "._" for part in ("weight", "bias")}}


def _mla_sections(setup: dict[str, Any], overrides: dict[str, Any]) -> dict[str, list[int]]:
    """The fused down projection holds the query's latent and the key-value one with the rotary key."""
    if not overrides.get("mla_down_proj_fusion"):
        return {}
    kv = overrides["kv_lora_rank"] + overrides["qk_pos_emb_head_dim"]
    return {"linear_qkv_down_proj.weight": [overrides["q_lora_rank"], kv]}


# MLA builds on Transformer Engine's spec only; a script runs it on the CPU through shardcheck's
# TE layer (TE's own Python, a CPU extension), which no script can carry inline
TE_ON_CPU = """\
try:  # Transformer Engine on a CPU: shardcheck's TE layer, installed before megatron-core is imported
    import shardcheck.megatron.cpu.te.install_on_import  # noqa: F401
except ImportError as missing:  # exit 2: neither reproduced (0) nor fixed (1)
    print(f"this script runs Transformer Engine on a CPU through shardcheck's TE layer: {missing}", file=sys.stderr)
    sys.exit(2)"""


def _moe_refuses(layout: Layout, options: dict[str, Any]) -> str | None:
    if layout.tp > 1 and _alltoall(options):
        return ("the alltoall dispatcher under tp > 1 gathers uneven pieces, which Gloo refuses "
                "(the audit pads them: cpu.py uneven_collectives)")
    return _router_refuses(layout, options)


def _alltoall(options: dict[str, Any]) -> bool:
    return options.get("moe_token_dispatcher_type") == "alltoall"


def _router_refuses(layout: Layout, options: dict[str, Any]) -> str | None:
    if layout.tp > 1 and not layout.sp:
        return "MoE with tp > 1 needs sequence parallelism (Megatron refuses it)"
    return None


def _refused_by(component: str) -> Callable[[Layout, dict[str, Any]], str | None]:
    """The layouts the component's own scenario refuses, with its reason."""
    return lambda layout, options: COMPONENTS[component].refuses(layout)


def _gdn_refuses(layout: Layout, options: dict[str, Any]) -> str | None:
    if layout.cp > 1 or layout.pp > 1:
        return "GatedDeltaNet runs without context parallelism (Megatron refuses it) in one stage"
    return None


def _mamba_refuses(layout: Layout, options: dict[str, Any]) -> str | None:
    if layout.pp > 1:
        return "a single Mamba mixer has no pipeline stages (pp = 1)"
    return None


@dataclasses.dataclass(frozen=True)
class Template:
    """One component's script (its setup dataclass is the component's): the snippets before its
    code, layout limits."""

    code: Snippet
    before: tuple[Snippet, ...] = ()
    refuses: Callable[[Layout, dict[str, Any]], str | None] = lambda layout, options: None
    # snippets some layouts or options need (the CP attention stand-in, the torch norm and
    # LLaVA's attention under sequence parallelism, the alltoall dispatcher's stand-ins)
    extras: tuple[tuple[Callable[[Layout, dict[str, Any]], bool], Snippet], ...] = ()
    # global section lengths of fused tp-sharded weights, by parameter name suffix
    sections: Callable[[dict[str, Any], dict[str, Any]], dict[str, list[int]]] | None = None
    preamble: str = ""  # run before megatron-core is imported (Transformer Engine's CPU layer)


GPT_SUPPORT = (RNG_ON_CPU, DEVICE_ON_CPU, CUDA_TENSORS_ON_CPU, STREAMS_ON_CPU, BASE, SEEDED, WEIGHTS, TRAINING)
SP_NORM = (lambda layout, options: layout.sp, NORM_UNDER_SP)
GPT_EXTRAS = (SP_NORM,
              (lambda layout, options: bool(options.get("num_moe_experts")), MOE_METRICS),
              (lambda layout, options: bool(options.get("recompute_granularity")), RECOMPUTE_ON_CPU),
              (lambda layout, options: layout.cp > 1, CP_ATTENTION),
              (lambda layout, options: layout.pp > 1, NO_SYNCHRONIZE))
TEMPLATES: dict[str, Template] = {
    "output_loss": Template(Snippet.of("output_loss"), (DEVICE_ON_CPU, BASE, SEEDED, PIECES, SHARD)),
    "moe_router": Template(ROUTER_CODE,
                           (DEVICE_ON_CPU, TE_GEMM_UNSET, BASE, SEEDED, PIECES, SHARD), _router_refuses),
    "gpt": Template(GPT_CODE, (*GPT_SUPPORT, LOCAL_SPEC),
                    sections=_gpt_sections, extras=GPT_EXTRAS),
    "moe": Template(GPT_CODE, (*GPT_SUPPORT, LOCAL_SPEC, MOE_METRICS, TE_GEMM_UNSET),
                    _moe_refuses, sections=_gpt_sections,
                    extras=(*GPT_EXTRAS, (lambda layout, options: _alltoall(options), ALLTOALL_ON_CPU))),
    "mtp": Template(GPT_CODE, (*GPT_SUPPORT, LOCAL_SPEC),
                    sections=_gpt_sections, extras=GPT_EXTRAS),
    "gdn": Template(GDN_CODE,
                    (RNG_ON_CPU, DEVICE_ON_CPU, CUDA_TENSORS_ON_CPU, STREAMS_ON_CPU, CAUSAL_CONV1D, GDN_KERNELS, BASE,
                     SEEDED, SHARD, WEIGHTS), _gdn_refuses, sections=_gdn_sections,
                    extras=(SP_NORM,)),
    "mamba": Template(MAMBA_CODE,
                      (RNG_ON_CPU, DEVICE_ON_CPU, STREAMS_ON_CPU, CAUSAL_CONV1D, MAMBA_KERNELS,
                       BASE, SEEDED, SHARD, WEIGHTS), _mamba_refuses, sections=_mamba_sections),
    "mla": Template(GPT_CODE, (*GPT_SUPPORT, MLA_SPEC), _refused_by("mla"), sections=_mla_sections, preamble=TE_ON_CPU,
                    extras=tuple(extra for extra in GPT_EXTRAS if extra is not SP_NORM)),  # TE's norms take SP
    "t5": Template(T5_CODE, GPT_SUPPORT, _refused_by("t5"),
                   sections=_gpt_sections, extras=(SP_NORM,)),
    "multimodal": Template(MULTIMODAL_CODE,
                           (*GPT_SUPPORT, CLIP_NORM), _refused_by("multimodal"), sections=_gpt_sections,
                           extras=(SP_NORM, (lambda layout, options: layout.sp, LLAVA_SP_ATTENTION))),
}


# the options whose models the templates do not build (they build Megatron's plain local layer specs)
UNSCRIPTED = {"impl": ("te", "a finding on Transformer Engine"), "heterogeneous": (True, "a heterogeneous GPT")}


def contract_of(finding: Finding) -> Contract | None:
    """The contract a finding breaks, when it is one of the catalogue's."""
    return BY_NAME.get(finding.contract.split(":", 1)[0])


def script_body(finding: Finding) -> ScriptBody:
    """The script code of an audit finding, from its component's template; ReproError if none."""
    template = TEMPLATES.get(finding.target)
    if template is None:
        raise ReproError(f"no repro template for component {finding.target!r} yet "
                         f"(templates: {', '.join(sorted(TEMPLATES))})")
    for option, (value, what) in UNSCRIPTED.items():
        if finding.config.get(option) == value:
            raise ReproError(f"no script for {what} yet: a script of the plain local spec would not run the code "
                             f"it names; rerun it with its reproduce command (finding {finding.id})")
    layout = Layout.parse(finding.layout)
    if why := template.refuses(layout, finding.config):
        raise ReproError(f"{why}; finding {finding.id} needs {finding.layout}")
    setup, overrides = _split_options(COMPONENTS[finding.target].setup, finding.config)
    fix = _fix(finding)
    constants = f"SETUP = {setup!r}\nOVERRIDES = {overrides!r}  # TransformerConfig options\n"
    if template.sections is not None:
        constants += f"SECTIONS = {template.sections(setup, overrides)!r}  # of fused weights, cut over tp\n"
    constants += f"SIZES = {_sizes(finding.layout)!r}\nONE_RANK = {_sizes('')!r}\n"
    extras = [snippet for needed, snippet in template.extras if needed(layout, finding.config)]
    if finding.kind == ONE_RANK_CRASH:  # it raises; the script shows where
        constants += f"RAISED = {_raised(finding)!r}  # the exception and the megatron-core file it comes from\n"
    own = [Snippet(constants), template.code, *([fix] if fix is not None else []),
           Snippet.of(_entry_points(finding, fix))]
    support = list(dict.fromkeys([*template.before, *extras]))  # a snippet once, needed twice or not
    return ScriptBody(code=_joined(own), support=_joined(support),
                      imports=_sorted_imports(s.imports for s in own + support),
                      has_corrected=fix is not None, sys_path=tuple(finding.sys_path), preamble=template.preamble)


def _entry_points(finding: Finding, fix: Snippet | None) -> str:
    """The part with the script's runs: a one-rank crash's, the fix's, or the plain ones."""
    if finding.kind == ONE_RANK_CRASH:
        return "crash_entry_points"
    return "fixed_entry_points" if fix is not None else "entry_points"


def _raised(finding: Finding) -> tuple[str, str]:
    """A one-rank crash's exception type (from its contract, ``runs on one rank (RuntimeError)``)
    and the megatron-core file it was raised in (its location, without the line)."""
    return finding.contract.rpartition("(")[2].rstrip(")"), finding.location.rsplit(":", 1)[0]


def _joined(snippets: list[Snippet]) -> str:
    return "\n\n\n".join(s.code.strip("\n") for s in snippets)


def _fix(finding: Finding) -> Snippet | None:
    """The finding's fix as script code: its contract's corrected function, or the model's
    groups for parallel_state's when the model's collectives ignore them."""
    if not _repaired(finding):
        return None
    if finding.contract == GLOBAL_GROUP_CONTRACT:
        return Snippet.of("groups_fix")
    name = (finding.control or {}).get("name", "")
    if name.startswith(piece_gradients.PREFIX):  # a gradient left partial at a split
        piece_fix = Snippet.of("piece_fix")
        return Snippet(f"PIECE_FIX = {piece_gradients.parse(name)!r}  # axis, pieces, split\n\n\n{piece_fix.code}",
                       piece_fix.imports)
    contract = contract_of(finding)
    if contract is None or contract.fix is None:
        return None
    module, attribute = contract.function.split(":")
    source = textwrap.dedent(inspect.getsource(contract.fix)).strip()
    return Snippet(code.CONTRACT_FIX.format(name=contract.name, module=module, attribute=attribute,
                                            source=source, fix=contract.fix.__name__),
                   "import importlib\nimport inspect")


def _repaired(finding: Finding) -> bool:
    """Whether the audit's corrected control showed the contract's fix repairing the finding:
    a fix that leaves it differing (another cause at the same call) is no fix of it, so its
    script gets no ``--fixed`` run. A finding with no control on record (from the fuzzer's store
    before controls were kept): yes."""
    if finding.control is not None:
        return bool(finding.control.get("equal_to_reference"))
    return not isinstance(finding.corrected, str) or finding.corrected.startswith(REPAIRED)


def _sorted_imports(parts) -> str:
    """The parts' import lines, each once, the names imported from one module on one line."""
    lines = {line for part in parts for line in part.splitlines() if line.strip()}
    names: dict[str, set[str]] = {}
    for line in [line for line in lines if re.fullmatch(r"from \S+ import [\w, ]+", line)]:
        module, _, imported = line.removeprefix("from ").partition(" import ")
        names.setdefault(module, set()).update(name.strip() for name in imported.split(","))
        lines.discard(line)
    lines |= {f"from {module} import {', '.join(sorted(imported))}" for module, imported in names.items()}
    return "\n".join(sorted(lines, key=lambda line: (line.startswith("from"), line)))


def _sizes(layout_text: str) -> dict[str, Any]:
    """The script's sizes of a layout (the reference's for ``''``), with parallel_state's rank
    order and the model's: another one for a layout with explicit groups (``...@cp-tp``)."""
    layout = Layout.parse(layout_text or "tp1")
    order = _megatron_order(layout.order.split("-"))
    explicit = layout_text.partition("@")[2]
    return {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "ep": layout.ep, "etp": layout.expert_tp, "sp": layout.sp,
            "order": order, "model_order": _megatron_order(explicit.split("-")) if explicit else order,
            "model_groups": list(CONSTRUCTED) if explicit else None, "whole_batch": not layout_text}


def _megatron_order(named: list[str]) -> str:
    """Megatron's rank order: the ``named`` dims first, then the others in its default order."""
    return "-".join(named + [d for d in DEFAULT_ORDER.split("-") if d not in named])


def _split_options(setup_cls: type, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The setup's fields (defaults with the options applied) and the TransformerConfig overrides."""
    fields = {f.name: f.default for f in dataclasses.fields(setup_cls)
              if f.name != "config" and f.default is not dataclasses.MISSING}
    try:
        chosen = setup_kwargs(setup_cls, options.items())
    except KeyError as why:
        raise ReproError(str(why)) from None
    setup = setup_cls(**chosen)
    derived = setup.derived_config() if hasattr(setup, "derived_config") else {}  # MLA's q_lora_rank, MTP's depth
    overrides = {**getattr(setup_cls, "base_config", {}), **derived, **chosen.pop("config", {})}
    return {**fields, **chosen}, overrides
