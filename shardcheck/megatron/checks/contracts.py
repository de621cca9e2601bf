"""Contracts for Megatron's mapping functions and key entry points, in R/P/S notation.

A :class:`Contract` names a megatron-core function, what its tensor arguments must be
(``requires``) and what each result means per axis (``ensures``). It is used three ways:

* **checker**: inside ``sc.typecheck`` the function runs through ``sc.contract``, so a call
  with wrongly laid-out arguments is reported where it happens (an argument still unknown
  to the checker is assumed to hold the required type);
* **probes**: each call's results are recorded on every rank, so the audit can rebuild their
  global value from ``ensures`` and compare it with the one-rank run: the first contract
  whose results part ways locates a numeric finding in megatron-core;
* **fixes**: where the contract makes the fix evident, ``fix`` is a corrected function the
  audit patches in to show that the corrected value equals the reference.

Where what a function must get right is not among its results (the MTP losses that
``process_mtp_loss`` hands to autograd, the gradient ``finalize_model_grads`` leaves in a
parameter), ``observe`` runs the call and returns what the probe records instead. The
embedding syncs ensure over pp only: a layout with other axes too is not compared there, so a
gradient gone wrong upstream (e.g. under cp) is not blamed on the sync. A
``downstream`` contract (the gradient norm) is reached by every gradient bug: it locates a
failure only when no contract upstream does. A contract whose function this megatron-core
does not have (it came, or went, with another release) is left out.

An ``ensures`` axis is a mesh axis (``tp``, ``cp``) or ``group:ARG``, the ranks of the process
group passed as argument ``ARG``. Placements: ``R`` (every rank holds the value), ``P`` (the
value is the sum over the axis), ``P(avg)`` (the mean over the axis: what the gradient
all-reduce averages), ``S(d)`` (concatenated along d; on ``cp`` in Megatron's load-balanced
chunk order). ``A|B`` in ``requires`` accepts either; a required ``V`` (per-rank values,
which a gather stacks) also accepts a partial count, whose pieces are collected, not summed.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.megatron.checks.paths import megatron_path
from shardcheck.patching import patched


@dataclass(frozen=True)
class Contract:
    """What a megatron-core function requires of its arguments and ensures of its results."""

    name: str
    function: str  # "module.path:attribute"
    requires: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    ensures: tuple[tuple[str, Mapping[str, str]], ...] = ()
    fix: Callable[..., Any] | None = None
    fix_note: str = ""
    trusted: bool = False  # the checker does not type the body; probes still check the result
    # (call, args, kwargs) -> (the call's result, the values the probe records for ``ensures``)
    observe: Callable[..., tuple[Any, Any]] | None = None
    downstream: bool = False  # every upstream bug reaches it: a location of last resort

    @property
    def attribute(self) -> str:
        """The name megatron-core modules refer to the function by."""
        return self.function.split(":")[1]

    def present(self) -> bool:
        """Whether this megatron-core has the function."""
        module, attribute = self.function.split(":")
        try:
            return hasattr(importlib.import_module(module), attribute)
        except ImportError:
            return False

    def original(self) -> Callable[..., Any]:
        module, attribute = self.function.split(":")
        return getattr(importlib.import_module(module), attribute)

    def location(self) -> str:
        """file:line of the function's definition in megatron-core."""
        fn = inspect.unwrap(_ORIGINALS.get(self.name) or self.original())
        return f"{megatron_path(inspect.getsourcefile(fn))}:{inspect.getsourcelines(fn)[1]}"

    def notation(self) -> str:
        """The contract in R/P/S notation, e.g. ``requires logits: tp=S(-1); ensures loss: tp=R``."""
        def spec(items):
            return "; ".join(f"{name}: " + ", ".join(f"{a}={p}" for a, p in types.items())
                             for name, types in items)
        parts = [f"requires {spec(self.requires.items())}"] if self.requires else []
        parts += [f"ensures {spec(self.ensures)}"] if self.ensures else []
        return f"{self.name}: " + "; ".join(parts)


# ---- fixes: corrected functions (used only for the audit's corrected controls) -------------

def _cross_entropy_with_global_smoothing(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
    """Vocab-parallel cross-entropy whose smoothing term averages over the whole vocabulary
    (``tp_group``: the model's group, which 0.19's callers pass)."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy

    takes_group = "tp_group" in inspect.signature(_VocabParallelCrossEntropy.forward).parameters
    given = (tp_group,) if tp_group is not None and takes_group else ()  # 0.16's takes none
    loss = _VocabParallelCrossEntropy.apply(vocab_parallel_logits.clone(), target, 0.0, *given)
    if label_smoothing <= 0:
        return loss
    logits = vocab_parallel_logits.float()
    group = mappings.get_tensor_model_parallel_group_if_none(tp_group)
    top = logits.max(dim=-1, keepdim=True)[0].detach()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sum_exp = mappings.reduce_from_tensor_model_parallel_region((logits - top).exp().sum(-1), group)
    vocab = logits.size(-1) * dist.get_world_size(group)
    mean_logit = mappings.reduce_from_tensor_model_parallel_region(logits.sum(-1), group) / vocab
    mean_log_probs = mean_logit - (sum_exp.log() + top.squeeze(-1))
    smoothing = label_smoothing * vocab / (vocab - 1)
    return (1.0 - smoothing) * loss - smoothing * mean_log_probs


def _token_count_before_reduce(routing_map, reduce_group, topk=None, with_padding_mask=False):
    """``get_tokens_per_expert_and_token_count`` reading the local count before the all-reduce."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    local_tokens_per_expert = routing_map.sum(dim=0)
    local_num_tokens = (local_tokens_per_expert.sum() / topk if with_padding_mask
                        else routing_map.shape[0])
    global_tokens_per_expert = reduce_from_tensor_model_parallel_region(
        local_tokens_per_expert.clone(), reduce_group)
    total_num_tokens = (global_tokens_per_expert.sum() / topk if with_padding_mask
                        else local_num_tokens * reduce_group.size())
    return global_tokens_per_expert, local_num_tokens, total_num_tokens


def _loss_over_global_token_count(*args, **kwargs):
    """``forward_step_calc_loss`` dividing each CP rank's loss sum by the CP-global token count."""
    from megatron.core import parallel_state as ps

    original = _ORIGINALS["forward_step_calc_loss"]
    bound = inspect.signature(original).bind(*args, **kwargs)
    loss_func = bound.arguments["loss_func"]

    def global_count(output_tensor):
        outputs = loss_func(output_tensor)
        if len(outputs) != 3 or ps.get_context_parallel_world_size() == 1:
            return outputs
        loss, num_tokens, reported = outputs
        total = num_tokens.clone().float()
        dist.all_reduce(total, group=ps.get_context_parallel_group())
        # Megatron divides by the local count next: pre-scale so that the quotient uses the
        # global count (over cp, times cp for the gradient average), keeping num_tokens intact
        per_rank = total.clamp(min=1) / ps.get_context_parallel_world_size()
        return loss * num_tokens.clamp(min=1) / per_rank, num_tokens, reported

    bound.arguments["loss_func"] = global_count if loss_func is not None else None
    return original(*bound.args, **bound.kwargs)


def _mtp_loss_over_global_counts(*args, **kwargs):
    """``process_mtp_loss`` normalising by token counts summed over the ranks that share the
    loss, not each rank's own: over cp, and for a per-token loss over dp too.

    Megatron takes the token count that ``roll_tensor`` returns with the rolled loss mask, a
    sum over this rank's tokens only (the tokens rolled out of the sequence all sit on CP
    rank 0). Here that count is the global one, divided by the cp size (the gradient
    average over cp undoes it), or, for a per-token loss (summed over every data-parallel and
    CP rank's tokens), the share of the global count that makes Megatron's ratio of counts
    the global ratio.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    original = _ORIGINALS["process_mtp_loss"]
    bound = inspect.signature(original).bind(*args, **kwargs).arguments
    group, config = bound.get("cp_group"), bound["config"]
    if config.calculate_per_token_loss:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if group is None or group.size() == 1 or bound.get("labels") is None:
        return original(*args, **kwargs)
    mask = bound.get("loss_mask")
    local = (mask if mask is not None else torch.ones_like(bound["labels"])).sum().double()
    total = local.clone()
    dist.all_reduce(total, group=group)
    share = local / total.clamp(min=1) if config.calculate_per_token_loss else 1.0 / group.size()
    rolling = mtp.roll_tensor

    def counted_over_cp(tensor, *roll_args, **roll_kwargs):
        rolled, count = rolling(tensor, *roll_args, **roll_kwargs)
        if count is None:
            return rolled, count
        summed = count.detach().double().clone()
        dist.all_reduce(summed, group=group)
        return rolled, (summed * share).to(count.dtype if count.is_floating_point() else torch.float32)

    mtp.roll_tensor = counted_over_cp  # not shardcheck.patching: repro scripts run this source alone
    try:
        return original(*args, **kwargs)
    finally:
        mtp.roll_tensor = rolling


def _mtp_losses(call: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """Run ``process_mtp_loss``; record each MTP layer's loss as the gradient sums it over cp
    and dp.

    The loss of layer k reaches autograd through ``MTPLossAutoScaler.apply(hidden, loss_k)``.
    DDP averages gradients over dp and cp unless the loss is per token, so the recorded sum of
    ``loss_k`` is divided by their sizes then: summed over cp and dp, it is the one-rank value.
    (Under dp the calls align with the one-rank run's only where its loss takes the whole
    batch in one micro-batch: a per-token loss, whose normalisation by this rank's own token
    counts then shows in its own result.)
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    bound = inspect.signature(_ORIGINALS["process_mtp_loss"]).bind(*args, **kwargs).arguments
    group, config = bound.get("cp_group"), bound["config"]
    averaged = 1 if config.calculate_per_token_loss else (
        (group.size() if group is not None else 1) * parallel_state.get_data_parallel_world_size())
    scaler, seen = mtp.MTPLossAutoScaler, []
    applied = scaler.apply

    def seeing(output, loss):
        seen.append(loss.detach().double().sum() / averaged)
        return applied(output, loss)

    with patched(scaler, "apply", seeing):
        result = call(*args, **kwargs)
    return result, (torch.stack(seen) if seen else None,)


def _embedding_grad(contract: str, table: str) -> Callable[..., tuple[Any, Any]]:
    """An observer of a finalize all-reduce: the gradient it leaves in this rank's ``table``
    (``word_embeddings``, ``position_embeddings``), None on a stage without one."""
    def observe(call: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, Any]:
        result = call(*args, **kwargs)
        bound = inspect.signature(_ORIGINALS[contract]).bind(*args, **kwargs).arguments
        params = [p for chunk in bound["model"] for name, p in chunk.named_parameters()
                  if name.endswith(f"{table}.weight")]
        grad = getattr(params[0], "main_grad", None) if params else None
        if params and grad is None:
            grad = params[0].grad
        return result, (grad,)
    return observe


def _position_embedding_grads_with_mtp_stage(model, config, pos_emb_group, pp_group):
    """The position-embedding all-reduce, with the MTP stage's copy of the table treated as
    Megatron treats its copy of the word embeddings: its gradient summed with the first
    stage's, and counted once in the gradient norm (marked ``shared``)."""
    from megatron.core import parallel_state

    _ORIGINALS["_allreduce_position_embedding_grads"](model, config, pos_emb_group, pp_group)
    pp = pp_group if pp_group is not None else parallel_state.get_pipeline_model_parallel_group()
    group = parallel_state.get_embedding_group()  # the first and the last stage
    if not getattr(config, "mtp_num_layers", None) or pp.size() == 1 or \
            dist.get_rank() not in dist.get_process_group_ranks(group):
        return
    for chunk in model:
        for name, param in chunk.named_parameters():
            if name.endswith("position_embeddings.weight"):
                dist.all_reduce(param.main_grad, group=group)
                param.shared = pp.rank() != 0


# ---- the catalogue --------------------------------------------------------------------------

CONTRACTS: tuple[Contract, ...] = (
    Contract(
        "vocab_parallel_cross_entropy",
        "megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy",
        requires={"vocab_parallel_logits": {"tp": "S(-1)"}, "target": {"tp": "R"}},
        ensures=(("loss", {"tp": "R"}),),
        fix=_cross_entropy_with_global_smoothing,
        fix_note="average the smoothing term's log-probabilities over the whole vocabulary "
                 "(all-reduce their sum over tp, divide by the global vocab size)"),
    Contract(
        "get_tokens_per_expert_and_token_count",
        "megatron.core.transformer.moe.moe_utils:get_tokens_per_expert_and_token_count",
        requires={"routing_map": {"tp": "S(0)"}},
        ensures=(("global_tokens_per_expert", {"group:reduce_group": "R"}),
                 ("local_num_tokens", {"group:reduce_group": "P"}),
                 ("total_num_tokens", {"group:reduce_group": "R"})),
        fix=_token_count_before_reduce,
        fix_note="read the local token count before the in-place all-reduce "
                 "(or all-reduce a clone)"),
    Contract(
        "forward_step_calc_loss",
        "megatron.core.pipeline_parallel.schedules:forward_step_calc_loss",
        ensures=(("output_tensor", {"tp": "R", "cp": "P(avg)"}), ("num_tokens", {"tp": "R", "cp": "P"})),
        fix=_loss_over_global_token_count,
        fix_note="divide each CP rank's masked loss sum by the token count summed over cp "
                 "(divided by the cp size, which the gradient average undoes)"),
    Contract(
        "process_mtp_loss",
        "megatron.core.transformer.multi_token_prediction:process_mtp_loss",
        ensures=(("mtp_losses", {"tp": "R", "cp": "P", "dp": "P"}),),
        observe=_mtp_losses,
        fix=_mtp_loss_over_global_counts,
        fix_note="normalise each MTP loss by the token count summed over cp (the rolled-out "
                 "tokens all sit on CP rank 0), and for a per-token loss over dp too, not by "
                 "this rank's own count"),
    Contract(
        "_allreduce_word_embedding_grads",
        "megatron.core.distributed.finalize_model_grads:_allreduce_word_embedding_grads",
        ensures=(("word_embeddings_grad", {"pp": "R"}),),
        observe=_embedding_grad("_allreduce_word_embedding_grads", "word_embeddings")),
    Contract(
        "_allreduce_position_embedding_grads",
        "megatron.core.distributed.finalize_model_grads:_allreduce_position_embedding_grads",
        ensures=(("position_embeddings_grad", {"pp": "R"}),),
        observe=_embedding_grad("_allreduce_position_embedding_grads", "position_embeddings"),
        fix=_position_embedding_grads_with_mtp_stage,
        fix_note="treat the MTP stage's position-embedding table as Megatron treats its word "
                 "embeddings: all-reduce its gradient with the first stage's and mark it shared "
                 "(counted once in the gradient norm)"),
    Contract(
        "get_grad_norm_fp32",
        "megatron.core.optimizer.clip_grads:get_grad_norm_fp32",
        ensures=(("total_norm", {"tp": "R", "cp": "R", "dp": "R", "pp": "R"}),),
        trusted=True, downstream=True),
    Contract(
        "reduce_from_tensor_model_parallel_region",
        "megatron.core.tensor_parallel.mappings:reduce_from_tensor_model_parallel_region",
        requires={"input_": {"tp": "P"}}),
    Contract(
        "copy_to_tensor_model_parallel_region",
        "megatron.core.tensor_parallel.mappings:copy_to_tensor_model_parallel_region",
        requires={"input_": {"tp": "R"}}),
    Contract(
        "gather_from_tensor_model_parallel_region",
        "megatron.core.tensor_parallel.mappings:gather_from_tensor_model_parallel_region",
        requires={"input_": {"tp": "S(-1)"}}),
    Contract(
        "gather_from_sequence_parallel_region",
        "megatron.core.tensor_parallel.mappings:gather_from_sequence_parallel_region",
        # S(0): a sequence shard, concatenated; V: per-rank values stacked in rank blocks,
        # e.g. the alltoall dispatcher collecting every rank's (partial) token counts
        requires={"input_": {"tp": "S(0)|V"}}),
    Contract(
        "reduce_scatter_to_sequence_parallel_region",
        "megatron.core.tensor_parallel.mappings:reduce_scatter_to_sequence_parallel_region",
        requires={"input_": {"tp": "P"}}),
)
BY_NAME = {contract.name: contract for contract in CONTRACTS}
_ORIGINALS: dict[str, Callable[..., Any]] = {}


# ---- recording probes, applying fixes ------------------------------------------------------

@dataclass
class ProbeRecord:
    """One call of a contracted function on one rank: its results and the groups it was given."""

    contract: str
    index: int
    results: list[torch.Tensor | None]
    groups: dict[str, tuple[int, ...]]


_RECORDS: list[list[ProbeRecord]] = []
_FIXED: set[str] = set()


def _group_ranks(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, dist.ProcessGroup):
        return tuple(dist.get_process_group_ranks(value))
    return None


def _as_results(result: Any) -> list[torch.Tensor | None]:
    items = result if isinstance(result, tuple | list) else (result,)
    return [torch.as_tensor(item).detach().double().clone()
            if isinstance(item, torch.Tensor | int | float) else None for item in items]


def _record(contract: Contract, fn: Callable[..., Any], args: tuple, kwargs: dict, result: Any) -> None:
    if not _RECORDS:
        return
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except TypeError:
        bound = {}
    groups = {name: ranks for name, value in bound.items() if (ranks := _group_ranks(value))}
    calls = _RECORDS[-1]
    index = sum(1 for r in calls if r.contract == contract.name)
    calls.append(ProbeRecord(contract.name, index, _as_results(result), groups))


def _wrapper(contract: Contract, original: Callable[..., Any]) -> Callable[..., Any]:
    def probed(*args: Any, **kwargs: Any) -> Any:
        fn = contract.fix if contract.name in _FIXED and contract.fix else original
        checked = _checked(contract, fn)
        if contract.observe is None:
            result = observed = checked(*args, **kwargs)
        else:
            result, observed = contract.observe(checked, args, kwargs)
        _record(contract, original, args, kwargs, observed)
        return result
    probed.__wrapped__ = original  # type: ignore[attr-defined]
    probed.__name__ = original.__name__
    return probed


def _checked(contract: Contract, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under the checker's contract hook when a typecheck region is active."""
    checker = sys.modules.get("shardcheck.typecheck.checker")
    if checker is None or checker.current() is None:
        return fn
    if contract.trusted:
        return _paused(checker.current(), fn)
    if not contract.requires:
        return fn
    from shardcheck.megatron.checks.typing import assume_required

    def run(*args: Any, **kwargs: Any) -> Any:
        requires = _on_passed_group(checker.current(), fn, contract.requires, args, kwargs)
        assume_required(fn, requires, args, kwargs)
        spec = _as_passed(fn, requires, args)
        result = checker.contract(args=spec, trusted=False)(fn)(*args, **kwargs)
        _check_results(checker.current(), contract, fn, args, kwargs, result)
        return result
    return run


def _on_passed_group(active: Any, fn: Callable[..., Any], requires: Mapping[str, Mapping[str, str]],
                     args: tuple, kwargs: dict) -> Mapping[str, Mapping[str, str]]:
    """The requirements, without those on tp where the ``group`` passed spans no tp ranks (an
    expert linear's etp group at an expert tp size other than tp's): they hold over tp."""
    ranks = _group_ranks(inspect.signature(fn).bind_partial(*args, **kwargs).arguments.get("group"))
    axes = active.mesh.axes_of(ranks) if ranks is not None else None
    if axes is None or "tp" in axes:
        return requires
    return {name: {axis: p for axis, p in types.items() if axis != "tp"} for name, types in requires.items()}


def _ensured_axes(active: Any, axis: str, bound: Mapping[str, Any]) -> tuple[str, ...]:
    """The mesh axes an ``ensures`` axis names: itself, or the axes of the group argument."""
    if not axis.startswith("group:"):
        return (axis,) if axis in active.names else ()
    ranks = _group_ranks(bound.get(axis.split(":", 1)[1]))
    return (active.mesh.axes_of(ranks) or ()) if ranks else ()


def _check_results(active: Any, contract: Contract, fn: Callable[..., Any], args: tuple,
                   kwargs: dict, result: Any) -> None:
    """Report results whose checker type breaks the contract's ``ensures`` (R, P and S only)."""
    from shardcheck.typecheck.checker import typeof
    from shardcheck.typecheck.types import parse_placement
    from shardcheck.typecheck.violations import Violation

    bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    values = result if isinstance(result, tuple | list) else (result,)
    for (name, types), value in zip(contract.ensures, values, strict=False):
        if not isinstance(value, torch.Tensor):
            continue
        actual = typeof(value)
        for axis, placement in types.items():
            if placement == "P(avg)":
                continue
            want = parse_placement(placement)
            for mesh_axis in _ensured_axes(active, axis, bound):
                got = actual.get(mesh_axis)
                if got is not None and got != want:
                    active.report(Violation("contract", active.names.index(mesh_axis),
                                            f"{contract.name} result {name} must be {mesh_axis}={want}"),
                                  "contract", (value,))


def _paused(active: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with active.paused():
            return fn(*args, **kwargs)
    return run


def _as_passed(fn: Callable[..., Any], requires: Mapping[str, Mapping[str, str]], args: tuple) -> dict:
    """The checker's argument spec: by position for arguments passed positionally, else by name."""
    names = list(inspect.signature(fn).parameters)
    return {names.index(name) if names.index(name) < len(args) else name: types
            for name, types in requires.items() if name in names}


def install() -> None:
    """Route every megatron-core reference to a contracted function through its probe (idempotent)."""
    for contract in CONTRACTS:
        if contract.name in _ORIGINALS or not contract.present():
            continue
        original = contract.original()
        _ORIGINALS[contract.name] = original
        probed = _wrapper(contract, original)
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("megatron") and \
                    getattr(module, contract.attribute, None) is original:
                setattr(module, contract.attribute, probed)


@contextmanager
def recording() -> Iterator[list[ProbeRecord]]:
    """Record every contracted call on this rank inside the block."""
    calls: list[ProbeRecord] = []
    _RECORDS.append(calls)
    try:
        yield calls
    finally:
        _RECORDS.pop()


@contextmanager
def fixed(names: tuple[str, ...]) -> Iterator[None]:
    """Run the named contracts' corrected functions inside the block."""
    unknown = [n for n in names if n not in BY_NAME or BY_NAME[n].fix is None]
    if unknown:
        raise KeyError(f"no fix for {unknown}")
    _FIXED.update(names)
    try:
        yield
    finally:
        _FIXED.difference_update(names)


@contextmanager
def probes_installed() -> Iterator[None]:
    """:func:`install` for the block only: every megatron-core reference is restored after it."""
    fresh = [c.name for c in CONTRACTS if c.name not in _ORIGINALS and c.present()]
    install()
    try:
        yield
    finally:
        for name in fresh:
            original, attribute = _ORIGINALS.pop(name), BY_NAME[name].attribute
            for module in list(sys.modules.values()):
                probe = getattr(module, attribute, None)
                if getattr(module, "__name__", "").startswith("megatron") and \
                        getattr(probe, "__wrapped__", None) is original:
                    setattr(module, attribute, original)
