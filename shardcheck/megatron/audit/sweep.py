"""The generic sweep: every component of the catalogue x CPU-compatible options x layouts, in a budget.

Options are found by introspection, never hand-picked:

* each component's setup dataclass: booleans, optional booleans, floats that default to 0
  (tried at 0.1) and strings whose choices a Megatron constructor declares as a ``Literal``;
* for components that take a ``config``: every boolean, ``Literal`` and ``Enum`` field of
  ``TransformerConfig`` (and so of ``ModelParallelConfig``), except the fields a layout sets
  and the fields the component pins for the CPU. A value whose config does not build on one
  rank (``TransformerConfig`` rejects it, or the sweep's own build fails) is not swept, with the
  reason (:func:`sweep_plan`); :mod:`shardcheck.megatron.audit.schedule` then leaves out values that
  fail or change nothing at one rank.

Layouts: every grid of tp, cp, dp, pp in {1, 2} up to ``max_world`` ranks, each with and
without sequence parallelism when tp > 1, and with ep=2 where dp*cp allows it; and, for each
grid over two or more of tp, cp, dp, the same grid with explicit groups (those of its reversed
rank order, e.g. ``tp2-dp2@dp-tp``) while Megatron's global groups keep the default order.
Cases are ordered so that a budget cut keeps the space covered evenly: first every component's
defaults under every layout (explicit-group layouts only for the components that pass the
groups to Megatron), then the defaults of the GPT family, GDN and Mamba on Transformer
Engine's layers at a few layouts (:data:`TE_LAYOUTS`) and a few option sets only TE runs
(:func:`te_option_sets`), then each option under each two-rank layout, then under the larger
ones (explicit-group layouts included, for the components that pass the groups).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib
import importlib.util
import inspect
import itertools
import re
import textwrap
import traceback
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardcheck.megatron.audit.annotations import literal_values, members, type_hints, unique
from shardcheck.parity.layout import Layout

LAYOUT_FIELDS = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
    "virtual_pipeline_model_parallel_size", "hierarchical_context_parallel_sizes",
    "hybrid_context_parallel", "pipeline_dtype",
})
# A setup's dicts of the model class's own arguments: ``Class.<arg>`` options go to its
# constructor, ``Class.forward.<arg>`` options to its forward call.
ARGUMENT_FIELDS = {"__init__": "model_args", "forward": "forward_args"}
SKIPPED_SETUP_FIELDS = frozenset({"seed", "config", "impl", *ARGUMENT_FIELDS.values()})
# The layers' implementation (a setup field of the GPT family, GDN and Mamba): Megatron's local
# torch modules or Transformer Engine's. Not swept like the other options: the default plan runs each
# component's defaults on TE at the layouts of TE_LAYOUTS, after the defaults tier
# (:func:`te_cases`); ``--set impl=te`` runs any options on it.
IMPL = "impl"
TE_LAYOUTS: dict[str, tuple[str, ...]] = {
    "gpt": ("tp2", "tp2-sp", "dp2", "pp2"),
    "moe": ("tp2-sp", "dp2-ep2", "tp2-dp2-ep2-sp"),
    "mtp": ("tp2", "pp2"),
    "gdn": ("tp2", "tp2-sp"),
    "mamba": ("tp2-sp", "cp2"),
}
# The model arguments a pipeline layout sets (which stage this rank builds), never swept.
STAGE_ARGUMENTS = frozenset({"pre_process", "post_process", "add_encoder", "add_decoder"})
FLOAT_TRY = 0.1


@dataclass(frozen=True)
class Case:
    """One run: a component, its non-default options (setup fields and config fields), a layout."""

    component: str
    options: tuple[tuple[str, Any], ...]
    layout: Layout

    @property
    def label(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options) or "defaults"
        return f"{self.component}[{opts}] @ {self.layout}"

    def with_layout(self, layout: Layout) -> Case:
        return Case(self.component, self.options, layout)


def impl_of(options: Iterable[tuple[str, Any]], component: str | None = None) -> str:
    """The implementation a case runs on: "te" (Transformer Engine) or "local", as its options
    choose, else as the component's setup does by default (``hybrid``: TE only)."""
    chosen = dict(options).get(IMPL)
    if chosen is None and component is not None:
        from shardcheck.megatron.scenarios import COMPONENTS

        chosen = getattr(COMPONENTS[component].setup, IMPL, None)
    return chosen or "local"


def te_cases(components: Iterable[str], layout_list: list[Layout]) -> list[Case]:
    """The default plan's Transformer Engine cases: each component of :data:`TE_LAYOUTS` with
    its defaults on TE, then each option set of :func:`te_option_sets`, at those of their
    layouts that ``layout_list`` holds."""
    given = {str(layout): layout for layout in layout_list}
    components = list(components)
    sets = [(component, ((IMPL, "te"),), TE_LAYOUTS.get(component, ())) for component in components]
    sets += [(component, options, names) for component in components
             for options, names in te_option_sets().get(component, ())]
    return [Case(component, options, given[name]) for component, options, names in sets
            for name in names if name in given]


def in_te_tier(case: Case) -> bool:
    """Whether the case is one of :func:`te_cases`: defaults on TE, or a TE option set at one of
    its layouts."""
    if case.options == ((IMPL, "te"),):
        return True
    return any(case.options == options and str(case.layout) in names
               for options, names in te_option_sets().get(case.component, ()))


def model_argument(name: str) -> tuple[str, str] | None:
    """``(setup field, argument)`` of an option naming a model class's own argument
    (``GPTModel.rope_scaling``, ``GPTModel.forward.runtime_gather_output``), else None."""
    head, dot, rest = name.partition(".")
    if not dot or not head[:1].isupper():
        return None
    method, dot, argument = rest.partition(".")
    return (ARGUMENT_FIELDS[method], argument) if dot and method in ARGUMENT_FIELDS else ("model_args", rest)


def setup_kwargs(setup_cls: type, options: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Split options into the setup's own fields, its ``config`` overrides and the model's own
    constructor and forward arguments."""
    own = {f.name for f in dataclasses.fields(setup_cls)}
    kwargs: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in options:
        argument = model_argument(name)
        if name in own and name not in ("config", *ARGUMENT_FIELDS.values()):
            kwargs[name] = value
        elif argument is not None and argument[0] in own:
            grouped.setdefault(argument[0], {})[argument[1]] = value
        elif argument is None and "config" in own:
            grouped.setdefault("config", {})[name] = config_value(name, value)
        else:
            raise KeyError(f"{setup_cls.__name__} has no option {name!r}")
    return {**kwargs, **grouped}


def _literal_choices(annotation: Any) -> tuple | None:
    """The values of the ``Literal`` alternatives of an annotation, else None."""
    literals = [m for m in members(annotation) if typing.get_origin(m) is typing.Literal]
    return tuple(unique([v for m in literals for v in literal_values(m)])) if literals else None


def _enum_type(annotation: Any) -> type[enum.Enum] | None:
    return next((m for m in members(annotation)
                 if isinstance(m, type) and issubclass(m, enum.Enum)), None)


def _is_bool(annotation: Any) -> bool:
    alternatives = members(annotation)
    return bool in alternatives and all(m in (bool, type(None)) for m in alternatives)


def values_to_try(annotation: Any, default: Any) -> list[Any]:
    """The values other than ``default`` that a field of this type can take (empty: not swept)."""
    if _is_bool(annotation):
        options = [True, False] + ([None] if type(None) in members(annotation) else [])
    elif (choices := _literal_choices(annotation)) is not None:
        options = list(choices)
    elif (kind := _enum_type(annotation)) is not None:
        options = list(kind)
    elif members(annotation) == [float] and default == 0.0:
        options = [FLOAT_TRY]
    else:
        options = []
    return [value for value in options if not (value == default and type(value) is type(default))]


def megatron_literals() -> dict[str, tuple]:
    """``Literal`` parameters of the Megatron constructors the catalogue builds, by name."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    found: dict[str, tuple] = {}
    for cls in (GPTModel,):
        for name, annotation in type_hints(cls.__init__).items():
            if (choices := _literal_choices(annotation)) is not None:
                found[name] = choices
    return found


def setup_options(setup_cls: type) -> list[tuple[str, Any]]:
    """Every non-default value of the setup dataclass's sweepable fields."""
    hints = type_hints(setup_cls)
    literals = megatron_literals()
    found: list[tuple[str, Any]] = []
    for f in dataclasses.fields(setup_cls):
        if f.name in SKIPPED_SETUP_FIELDS or f.default is dataclasses.MISSING:
            continue
        annotation = hints[f.name]
        if annotation is str:
            choices = literals.get(f.name) or literals.get(f"{f.name}_type") or ()
            found += [(f.name, c) for c in choices if c != f.default]
        else:
            found += [(f.name, v) for v in values_to_try(annotation, f.default)]
    return found


def _gpt_setup_class(component: str) -> type:
    """The GPT setup whose configuration the component's ``config`` options modify (the MoE
    GPT's for a component with experts, such as the router)."""
    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.megatron.scenarios.gpt import GPTSetup, MoEGPTSetup

    entry = COMPONENTS[component]
    if issubclass(entry.setup, GPTSetup):
        return entry.setup
    return MoEGPTSetup if entry.experts else GPTSetup


def config_class(component: str) -> type:
    """The Megatron config class of the component (``MLATransformerConfig`` for ``mla``, else
    ``TransformerConfig``), whose fields its ``config`` options set."""
    return _gpt_setup_class(component)().config_type()


def pinned_config_fields(component: str) -> frozenset[str]:
    """Config fields the component sets itself (its CPU choices), which the sweep leaves alone."""
    from shardcheck.megatron.scenarios.gpt import transformer_config

    ours, cls = transformer_config(Layout(), _gpt_setup_class(component)()), config_class(component)
    required = {"num_layers": ours.num_layers, "hidden_size": ours.hidden_size,
                "num_attention_heads": ours.num_attention_heads}
    plain = cls(**required)
    return frozenset(f.name for f in dataclasses.fields(cls)
                     if f.name not in required and getattr(ours, f.name) != getattr(plain, f.name))


SIZE_FIELDS = frozenset({"num_layers", "hidden_size", "num_attention_heads"})  # the setup's own
NONE_TRY = (1, 2, 4, 8)


def integer_values(annotation: Any, default: Any) -> list[Any]:
    """Candidates for an integer field (optional or not): ``n -> n + 1``; an optional one that
    defaults to None, the smallest of :data:`NONE_TRY` the caller accepts (all are returned,
    smallest first). Empty for any other type."""
    kinds = members(annotation)
    if int not in kinds or bool in kinds or float in kinds:
        return []
    if default is None:
        return list(NONE_TRY)
    return [default + 1] if isinstance(default, int) and not isinstance(default, bool) else []


Unbuilt = dict[tuple[tuple[str, Any], ...], str]  # options whose config does not build -> why


def config_options(component: str) -> tuple[list[tuple[str, Any]], Unbuilt]:
    """Non-default values of TransformerConfig's boolean, Literal and Enum fields, and of its
    integer fields (see :func:`integer_values`; the first value accepted): those whose config
    builds on one rank, and the others with why (an integer field none of whose values builds
    is listed at its first value), and the auxiliary losses' weights that default to off
    (:data:`LOSS_COEFFICIENT`). A component with a ``config_prefix`` gets the fields with that
    prefix, and the boolean, Literal and Enum fields (and weights) its ``config_code`` reads."""
    from shardcheck.megatron.scenarios import COMPONENTS

    cls = config_class(component)
    hints = type_hints(cls)
    skip = LAYOUT_FIELDS | pinned_config_fields(component)
    prefix, read = COMPONENTS[component].config_prefix, fields_read(COMPONENTS[component].config_code, cls)
    found: list[tuple[str, Any]] = []
    for f in dataclasses.fields(cls):
        if (f.name in skip or f.default is dataclasses.MISSING
                or not (f.name.startswith(prefix) or f.name in read)):
            continue
        found += [(f.name, v) for v in values_to_try(hints[f.name], f.default)
                  if not isinstance(v, float)]
        if f.name.endswith(LOSS_COEFFICIENT) and not f.default:  # an auxiliary loss switched on
            found.append((f.name, COEFFICIENT_TRIED))
    unbuilt = {(option,): why for option in found if (why := config_failure(component, option))}
    accepted = [option for option in found if (option,) not in unbuilt]
    for f in dataclasses.fields(cls):  # sizes: the component's own prefix only
        if f.name in skip | SIZE_FIELDS or f.default is dataclasses.MISSING or not f.name.startswith(prefix):
            continue
        tried = [((f.name, v), config_failure(component, (f.name, v)))
                 for v in integer_values(hints[f.name], f.default)]
        accepted += [option for option, why in tried if why is None][:1]
        if tried and all(why for _, why in tried):
            unbuilt[(tried[0][0],)] = f"{tried[0][1]} (and every other value tried)"
    return accepted, unbuilt


# an auxiliary loss's weight (moe_z_loss_coeff, dsa_indexer_loss_coeff), off by default: tried
# at this value, as a setup's float that defaults to 0 is
LOSS_COEFFICIENT, COEFFICIENT_TRIED = "_loss_coeff", 0.1
CONFIG_READ = re.compile(r"\bconfig\.([A-Za-z_]\w*)")


@functools.cache
def fields_read(modules: tuple[str, ...], config_cls: type | None = None) -> frozenset[str]:
    """The fields of ``config_cls`` (default ``TransformerConfig``) that the source of
    ``modules`` (a module, or every module of a package) reads as ``config.NAME``; read from
    the megatron-core imported, so from a ``--megatron`` tree's own source."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    names: set[str] = set()
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            continue
        root = Path(spec.origin)
        files = sorted(root.parent.rglob("*.py")) if spec.submodule_search_locations else [root]
        for path in files:
            names.update(CONFIG_READ.findall(path.read_text(encoding="utf-8")))
    return frozenset(names) & {f.name for f in dataclasses.fields(config_cls or TransformerConfig)}


def config_failure(component: str, *options: tuple[str, Any]) -> str | None:
    """Why the component's config with the options together does not build on one rank, else
    None: ``TransformerConfig`` rejects them, or the sweep's own build fails (a bug in shardcheck)."""
    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.megatron.scenarios.gpt import transformer_config

    setup = COMPONENTS[component].setup(**setup_kwargs(COMPONENTS[component].setup, options))
    try:
        transformer_config(Layout(), _gpt_setup_class(component)(config=getattr(setup, "config", {})))
    except Exception as exc:  # noqa: BLE001 - any failure leaves the value out, with its reason
        return _build_failure(exc)
    return None


CONFIG_REJECTS = "TransformerConfig rejects it"
BUILD_FAILS = "the sweep cannot build its config (a bug in shardcheck)"


def _build_failure(exc: BaseException) -> str:
    """Why a config did not build: megatron-core's own rejection (raised in its code) or a
    failure of shardcheck's build, with the exception's last line."""
    frames = traceback.extract_tb(exc.__traceback__)
    megatron = any("/megatron/core/" in frame.filename for frame in frames)
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return f"{CONFIG_REJECTS if megatron else BUILD_FAILS}: {last}"


def _same_value(a: Any, b: Any) -> bool:
    """Config values equal, init functions by name (``__post_init__`` builds new closures)."""
    if callable(a) and callable(b):
        return getattr(a, "__qualname__", type(a)) == getattr(b, "__qualname__", type(b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are taken as changed
        return False


def changed_config_fields(component: str, options: tuple, layout: Layout) -> frozenset[str] | None:
    """The config fields whose built value under ``layout`` differs from the defaults': the
    options' own fields and what TransformerConfig's ``__post_init__`` derives from them.
    None when the options set a field of the setup itself or a model argument, or the config
    does not build."""
    built = _built_configs(component, options, layout)
    if built is None:
        return None
    with_options, base = built
    return frozenset(f.name for f in dataclasses.fields(config_class(component))
                     if not _same_value(getattr(with_options, f.name), getattr(base, f.name)))


def _built_configs(component: str, options: tuple, layout: Layout) -> tuple[Any, Any] | None:
    """The TransformerConfig under ``layout`` with the options and without them; None when the
    options set a field of the setup itself or a model argument, or a config does not build."""
    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.megatron.scenarios.gpt import transformer_config

    setup_cls = COMPONENTS[component].setup
    own = {f.name for f in dataclasses.fields(setup_cls)} - {"config"}
    if not options or any(name in own or model_argument(name) for name, _ in options):
        return None
    config = setup_kwargs(setup_cls, options).get("config", {})
    gpt_setup = _gpt_setup_class(component)
    try:
        return transformer_config(layout, gpt_setup(config=config)), transformer_config(layout, gpt_setup())
    except Exception:  # noqa: BLE001 - not dropped: the case runs, and its run reports the failure
        return None


def layout_dependent_fields(component: str, options: tuple, layout: Layout) -> dict[str, tuple[Any, Any]]:
    """Config fields whose value the options make depend on the parallel sizes, each with its
    value under ``layout`` and on one rank: TransformerConfig derives them from the layout
    (``moe_router_topk_limited_devices`` sets ``moe_router_num_groups`` to the expert-parallel
    size), so the one-rank run of the same options computes something else. A field that
    differs without the options too (``expert_tensor_parallel_size``) is the layout's own."""
    here, alone = _built_configs(component, options, layout), _built_configs(component, options, Layout())
    if here is None or alone is None:
        return {}
    (ours, base), (one_rank, one_rank_base) = here, alone
    return {f.name: (getattr(ours, f.name), getattr(one_rank, f.name))
            for f in dataclasses.fields(config_class(component))
            if f.name not in LAYOUT_FIELDS
            and not _same_value(getattr(ours, f.name), getattr(one_rank, f.name))
            and _same_value(getattr(base, f.name), getattr(one_rank_base, f.name))}


# Options TransformerConfig accepts only together (its validation refuses each one alone): full
# recomputation needs a method and a layer count; activations distributed over tp need it too.
_FULL = (("recompute_granularity", "full"), ("recompute_num_layers", 1))
FULL_BUNDLES: tuple[tuple[tuple[str, Any], ...], ...] = (
    (*_FULL, ("recompute_method", "uniform")),
    (*_FULL, ("recompute_method", "block")),
    (*_FULL, ("recompute_method", "uniform"), ("distribute_saved_activations", True)),
)
SELECTIVE = ("recompute_granularity", "selective")


def te_option_sets() -> dict[str, tuple[tuple[tuple[tuple[str, Any], ...], tuple[str, ...]], ...]]:
    """Option sets the default plan runs on Transformer Engine beyond the defaults, each with
    its layouts: megatron-core code that runs only on TE's modules with an FP8 recipe, the
    recipe run unquantised (:func:`shardcheck.megatron.cpu.te.unquantised`).

    MTP's full recomputation with activations distributed over tp goes through ``te_checkpoint``
    under FP8 (``_checkpointed_forward``'s quantised branch; without TE it raises ImportError),
    plain and with explicit groups: one MTP layer (with two, the second's checkpoint flattens
    the first's output, which the MTP block keeps: the one-rank crash of the bundle without
    FP8) and rotary positions (megatron.training refuses MTP with learned ones).

    The GPT's packed sequences (THD, ``cu_seqlens``) run on TE's attention only (megatron-core's
    local attention refuses them): in bf16, as Megatron trains, so TE runs its fused attention
    on them (in fp32 it converts them to a padded batch with a custom op the checker has no
    rule for), with the packed row split by sequence parallelism, and whole packed
    micro-batches per data-parallel rank under explicit groups.

    MLA's fused down projection (``FusedMLASelfAttention``, megatron-core 0.19 on) is built by
    TE's layer spec only."""
    quantised_recompute = ((IMPL, "te"), ("mtp_layers", 1), ("position_embedding", "rope"),
                           ("fp8", "hybrid"), *FULL_BUNDLES[2])
    packed = ((IMPL, "te"), ("packed_sequences", True), ("bf16", True))
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fused_mla = ((("mla_down_proj_fusion", True),), ("tp2-sp",))
    return {"mtp": ((quantised_recompute, ("tp2-dp2", "tp2-dp2@dp-tp")),),
            "gpt": ((packed, ("tp2-sp", "tp2-dp2@dp-tp")),),
            **({"mla": (fused_mla,)} if hasattr(MLATransformerConfig, "mla_down_proj_fusion") else {})}


@functools.cache
def list_fields() -> frozenset[str]:
    """TransformerConfig's fields that hold a list (``recompute_modules``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return frozenset(name for name, annotation in type_hints(TransformerConfig).items()
                     if any(typing.get_origin(m) is list for m in members(annotation)))


def config_value(name: str, value: Any) -> Any:
    """An option's value as TransformerConfig takes it: a list field is given as one
    comma-separated string (hashable in a :class:`Case`, and as ``--set`` writes it), and one
    that also takes a single string (``moe_router_load_balancing_type``) keeps a string
    without a comma as it is."""
    if not isinstance(value, str) or name not in list_fields():
        return value
    return value if "," not in value and name in string_fields() else value.split(",")


@functools.cache
def string_fields() -> frozenset[str]:
    """TransformerConfig's fields that take a string."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return frozenset(name for name, annotation in type_hints(TransformerConfig).items()
                     if str in members(annotation))


@functools.cache
def recompute_modules() -> tuple[str, ...]:
    """The submodules selective recomputation accepts besides its default (``core_attn``), read
    from the ``allowed_modules`` set TransformerConfig's ``__post_init__`` checks
    ``recompute_modules`` against (none where a release has no such set)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    tree = ast.parse(textwrap.dedent(inspect.getsource(TransformerConfig.__post_init__)))
    selective = [node for node in ast.walk(tree) if isinstance(node, ast.If)
                 and "recompute_granularity" in ast.unparse(node.test) and "selective" in ast.unparse(node.test)]
    allowed = next((node.value for block in selective for node in ast.walk(block)
                    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Set)
                    and any(isinstance(t, ast.Name) and t.id == "allowed_modules" for t in node.targets)), None)
    if allowed is None:
        return ()
    default = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1).recompute_modules
    return tuple(ast.literal_eval(element) for element in allowed.elts
                 if ast.literal_eval(element) not in default)


def bundles() -> tuple[tuple[tuple[str, Any], ...], ...]:
    """Options swept together: full recomputation (:data:`FULL_BUNDLES`) and selective
    recomputation of each submodule it accepts (:func:`recompute_modules`; its default,
    ``core_attn``, is the single option ``recompute_granularity=selective``)."""
    return (*FULL_BUNDLES, *((SELECTIVE, ("recompute_modules", module)) for module in recompute_modules()))


def option_bundles(component: str) -> list[tuple[tuple[str, Any], ...]]:
    """The :func:`bundles` that the component's config accepts (none without a config)."""
    return screened_bundles(component)[0]


def screened_bundles(component: str) -> tuple[list[tuple[tuple[str, Any], ...]], Unbuilt]:
    """The :func:`bundles` whose config builds for the component, and the others with why (none
    without a config). Every component with a config takes them, whatever its prefix:
    recomputation reruns the component's own layers (MTP's ``_checkpointed_forward``, the MoE
    layer's checkpoints), under each layout the component runs under."""
    from shardcheck.megatron.scenarios import COMPONENTS

    if "config" not in {f.name for f in dataclasses.fields(COMPONENTS[component].setup)}:
        return [], {}
    candidates = (*bundles(), *split_free_bundles(component))
    unbuilt = {bundle: why for bundle in candidates
               if (why := CPU_LIMITS.get(bundle) or config_failure(component, *bundle))}
    return [bundle for bundle in candidates if bundle not in unbuilt], unbuilt


PER_TOKEN = ("calculate_per_token_loss", True)
LOSS_TYPE = "moe_router_load_balancing_type"


def split_free_bundles(component: str) -> list[tuple[tuple[str, Any], ...]]:
    """Each sequence-level auxiliary loss type with the per-token loss, for a component whose
    megatron-core code reads the loss type: only together do they make the loss independent of
    the micro-batch split, so that the one-rank reference takes the whole batch in one
    micro-batch (:func:`~shardcheck.megatron.scenarios.gpt.split_free`) and a term scaled by
    the micro-batch size parts ways with it (Megatron-LM e3fe5508c9); each alone does not."""
    from shardcheck.megatron.scenarios import COMPONENTS
    from shardcheck.megatron.scenarios.gpt import PER_SEQUENCE_AUX_LOSSES

    if LOSS_TYPE not in fields_read(COMPONENTS[component].config_code):
        return []
    return [((LOSS_TYPE, kind), PER_TOKEN) for kind in sorted(PER_SEQUENCE_AUX_LOSSES)]


# Bundles the CPU cannot run yet, with why (listed as not swept): under the recompute patch
# (docs/megatron.md) the dense MLP's checkpoint reruns its own backward without end.
CPU_LIMITS: dict[tuple[tuple[str, Any], ...], str] = {
    (SELECTIVE, ("recompute_modules", "mlp")): (
        "shardcheck's CPU recompute patch cannot run it yet: the dense MLP's checkpoint reruns its "
        "backward without end on one rank"),
}


def model_class(component: str) -> type | None:
    """The Megatron model class the component's scenario builds (``Component.model``)."""
    from shardcheck.megatron.scenarios import COMPONENTS

    path = COMPONENTS[component].model
    if not path:
        return None
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def model_options(component: str) -> list[tuple[str, Any]]:
    """Non-default values of the model class's own boolean, ``Literal`` and ``Enum`` arguments,
    of its constructor (``Class.<arg>``) and of its forward (``Class.forward.<arg>``), that the
    scenario leaves at their defaults; for a component that names its model class (the GPT's
    MoE and MTP variants name none: ``gpt`` sweeps GPTModel's) and whose setup holds them."""
    from shardcheck.megatron.scenarios import COMPONENTS

    entry, cls = COMPONENTS[component], model_class(component)
    own = {f.name for f in dataclasses.fields(entry.setup)}
    if cls is None:
        return []
    found = []
    for method, setup_field in ARGUMENT_FIELDS.items():
        if setup_field not in own:
            continue
        function, prefix = getattr(cls, method), cls.__name__ + ("" if method == "__init__" else f".{method}")
        hints, passed = type_hints(function), passed_by_scenario(component, method) | STAGE_ARGUMENTS
        for name, parameter in inspect.signature(function).parameters.items():
            if name in passed or parameter.default is inspect.Parameter.empty or name not in hints:
                continue
            found += [(f"{prefix}.{name}", v) for v in values_to_try(hints[name], parameter.default)
                      if not isinstance(v, float)]
    return found


def passed_by_scenario(component: str, method: str) -> frozenset[str]:
    """The arguments of the model class's ``method`` that the scenario's module passes itself:
    every keyword, and the parameters its positional arguments fill, at each call of the class
    (``__init__``) or of the built model (``forward``: a call of a name ``model``)."""
    from shardcheck.megatron.scenarios import COMPONENTS

    cls = model_class(component)
    callee = cls.__name__ if method == "__init__" else "model"
    parameters = [name for name in inspect.signature(getattr(cls, method)).parameters if name != "self"]
    tree = ast.parse(inspect.getsource(inspect.getmodule(COMPONENTS[component].run)))
    passed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called_name(node.func) == callee:
            passed |= {keyword.arg for keyword in node.keywords if keyword.arg}
            passed |= set(parameters[:len(node.args)])
    return frozenset(passed)


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def component_options(component: str) -> list[tuple[str, Any]]:
    """All candidate single options of a component, setup fields first."""
    return screened_options(component)[0]


def screened_options(component: str) -> tuple[list[tuple[str, Any]], Unbuilt]:
    """The component's candidate single options (setup fields first), and the config values
    left out because their config does not build, with why."""
    from shardcheck.megatron.scenarios import COMPONENTS

    setup_cls = COMPONENTS[component].setup
    found, unbuilt = setup_options(setup_cls), {}
    if "config" in {f.name for f in dataclasses.fields(setup_cls)}:
        config, unbuilt = config_options(component)
        found += config
    return found + model_options(component), unbuilt


def layouts(max_world: int = 4, explicit: bool = False) -> list[Layout]:
    """Every tp/cp/dp/pp grid of sizes 1 or 2 within ``max_world`` ranks, with sp and ep
    variants, the tp-only grid with an expert tp of 1 (ep 1 or tp: ``tp2-etp1-sp``,
    ``tp2-ep2-etp1-sp``), and with ``explicit`` their explicit-group variants
    (:func:`explicit_layouts`)."""
    found: list[Layout] = []
    for tp, cp, dp, pp in itertools.product((1, 2), repeat=4):
        if tp * cp * dp * pp > max_world or tp * cp * dp * pp == 1:
            continue
        for sp in (False, True) if tp > 1 else (False,):
            found.append(Layout(tp=tp, cp=cp, dp=dp, pp=pp, sp=sp))
            if (dp * cp) % 2 == 0 and dp > 1:
                found.append(Layout(tp=tp, cp=cp, dp=dp, pp=pp, sp=sp, ep=2))
        if tp * cp * dp * pp == tp > 1:  # experts not cut over tp: alone, or cut over ep instead
            found += [Layout(tp=tp, sp=True, etp=1), Layout(tp=tp, sp=True, ep=tp, etp=1)]
    found += explicit_layouts(found) if explicit else []
    # the expert-tp variants last among their size: an option the default plan has not run yet
    # runs at the first layout that reads it, tp2-sp before them
    return sorted(found, key=lambda lay: (lay.world_size, lay.etp is not None, str(lay)))


def explicit_layouts(plain: list[Layout]) -> list[Layout]:
    """For each layout over two or more of tp, cp, dp (without pp or ep): the same layout with
    the groups of its reversed rank order as explicit groups.

    Explicit pipeline groups are left out: where a collective ignores the explicit groups it
    mixes ranks of different stages, which deadlocks instead of giving numbers.
    """
    found = []
    for layout in plain:
        dims = [d for d in ("tp", "cp", "dp") if layout.size(d) > 1]
        if len(dims) >= 2 and layout.pp == 1 and layout.ep == 1:
            found.append(layout.regrouped("-".join(reversed(dims))))
    return found


def runs_under(component: str, layout: Layout) -> bool:
    """Whether the component runs under the layout: explicit groups need a component that
    passes them to Megatron (``Component.explicit_groups``)."""
    if not layout.explicit_groups:
        return True
    from shardcheck.megatron.scenarios import COMPONENTS

    entry = COMPONENTS.get(component)
    return bool(entry and entry.explicit_groups)


def parse_value(text: str) -> Any:
    """A ``--set`` value: true/false/none, a number, else the string."""
    lowered = text.strip().lower()
    special = {"true": True, "false": False, "none": None}
    if lowered in special:
        return special[lowered]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def plan(components: Mapping[str, list[tuple[str, Any]]], layout_list: list[Layout],
         budget: int | None, bundles: Mapping[str, list[tuple]] | None = None) -> list[Case]:
    """Cases in coverage order (see the module docstring), cut to ``budget`` runs; each of a
    component's ``bundles`` (options set together) is swept as one more option."""
    def tier(option_sets: list[tuple[str, tuple]], tier_layouts: list[Layout]) -> Iterator[Case]:
        for layout in tier_layouts:
            for component, options in option_sets:
                if runs_under(component, layout):
                    yield Case(component, options, layout)

    defaults = [(c, ()) for c in components]
    singles = [(c, (option,)) for c, options in components.items() for option in options]
    singles += [(c, bundle) for c, sets in (bundles or {}).items() for bundle in sets]
    small = [lay for lay in layout_list if lay.world_size <= 2]
    large = [lay for lay in layout_list if lay.world_size > 2]
    ordered = itertools.chain(tier(defaults, layout_list), te_cases(components, layout_list),
                              _interleave(singles, small), _interleave(singles, large))
    return list(itertools.islice(ordered, budget))


def components_plan(names: Iterable[str], layout_list: list[Layout]) -> list[Case]:
    """The whole plan for the named components: every single option and bundle they accept."""
    return sweep_plan(names, layout_list)[0]


def sweep_plan(names: Iterable[str], layout_list: list[Layout]) -> tuple[list[Case], dict[tuple, str]]:
    """:func:`components_plan`, and the option sets it leaves out because their config does not
    build on one rank, as ``(component, options) -> why`` (the audit lists them as not swept)."""
    options, bundles, unbuilt = {}, {}, {}
    for component in names:
        options[component], left_out = screened_options(component)
        bundles[component], left_out_bundles = screened_bundles(component)
        unbuilt |= {(component, key): why for key, why in (left_out | left_out_bundles).items()}
    return plan(options, layout_list, None, bundles=bundles), unbuilt


def _interleave(option_sets: list[tuple[str, tuple]], tier_layouts: list[Layout]) -> Iterator[Case]:
    """Each option under each layout it runs under (explicit groups: the components that pass
    them), round-robin over options so a cut spreads evenly."""
    for shift in range(len(tier_layouts)):
        for i, (component, options) in enumerate(option_sets):
            layout = tier_layouts[(i + shift) % len(tier_layouts)]
            if runs_under(component, layout):
                yield Case(component, options, layout)
