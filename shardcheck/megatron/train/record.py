"""Record what each training step of ``megatron.training.pretrain`` produced, on each rank.

Three wrappers, installed before ``pretrain`` runs, observe without changing anything:

- ``train_step`` returns the step's reduced ``lm loss``, grad norm and num-zeros;
- the optimizer's ``step`` (wrapped once ``setup_model_and_optimizer`` built it) first reads
  each parameter's gradient (``main_grad``, reduced by ``finalize_model_grads``) as a sum of
  squares, keyed by the parameter's global name and, for a tensor-parallel shard, its rank in
  the tensor-parallel group (under torch FSDP2 also its data-parallel rank: each holds a share),
  so that the parent can add shards and drop replicas;
- the model ``setup_model_and_optimizer`` built is checked against the flags
  (:mod:`shardcheck.megatron.train.model_check`) and its layers' module classes recorded;
- a forward hook on each MoE router counts the tokens each expert received, keyed by which
  tokens this rank holds (its data-parallel and context-parallel ranks, and its tensor-parallel
  rank under sequence parallelism).

Each rank writes ``rank<R>.json`` to the folder named by ``SHARDCHECK_TRAIN_RECORD``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardcheck.megatron.train.model_check import check_built_model
from shardcheck.patching import patched_attrs

RECORD_ENV = "SHARDCHECK_TRAIN_RECORD"
SAVE_INIT_ENV = "SHARDCHECK_TRAIN_SAVE_INIT"
TYPECHECK_ENV = "SHARDCHECK_TRAIN_TYPECHECK"
ENTRY_SCRIPT = Path(__file__).with_name("entry.py")  # our GPT entry point: harness code to the checker


class StepRecorder:
    """The per-step metrics of this rank, written to ``folder/rank<R>.json`` after every step."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.steps: list[dict[str, Any]] = []
        self.pending: dict[str, Any] = {}
        self.model: list[Any] = []
        self.token_counts: dict[str, list[int]] = {}
        self.violations: list[str] = []
        self.layers: dict[int, str] = {}

    # --- what the wrappers report -------------------------------------------------------
    def grads_seen(self, model: list[Any]) -> None:
        self.pending["params"] = _param_sums(model)
        self.pending["tokens"] = {layer: counts for layer, counts in self.token_counts.items()}
        self.token_counts.clear()

    def step_done(self, loss: dict[str, Any], grad_norm: Any, num_zeros: Any) -> None:
        from megatron.core import parallel_state as ps
        from megatron.training import get_args

        step = get_args().curr_iteration + 1  # a resumed run goes on counting from its checkpoint
        record = {"step": step, "loss": {k: float(v) for k, v in loss.items()},
                  "grad_norm": _number(grad_norm), "num_zeros": _number(num_zeros),
                  "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True), **self.pending}
        self.pending = {}
        self.steps.append(record)
        self.write()

    def write(self) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        meta = _rank_meta()
        path = self.folder / f"rank{rank}.json"
        path.write_text(json.dumps({"rank": rank, **meta, "steps": self.steps, "violations": self.violations,
                                    "layers": self.layers}))

    # --- installing ------------------------------------------------------------------------
    def install(self) -> None:
        from megatron.training import training

        training.train_step = self._wrap_train_step(training.train_step)
        training.setup_model_and_optimizer = self._wrap_setup(training.setup_model_and_optimizer)

    def _wrap_train_step(self, train_step: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            if os.environ.get(TYPECHECK_ENV) == "1":
                result = self._typechecked(train_step, *args, **kwargs)
            else:
                result = train_step(*args, **kwargs)
            self.pending["seconds"] = time.perf_counter() - start
            loss, grad_norm, num_zeros = result[0], result[5], result[6]
            self.step_done(loss, grad_norm, num_zeros)
            return result

        return recorded

    def _typechecked(self, train_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One training step under the type checker (collect mode); new violation lines kept."""
        from types import SimpleNamespace

        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from shardcheck.megatron.checks import contracts
        from shardcheck.megatron.checks.typecheck import checked_region
        from shardcheck.typecheck.locations import harness_code

        groups = {"tp": ps.get_tensor_model_parallel_group(), "cp": ps.get_context_parallel_group(),
                  "dp": ps.get_data_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
                  "ep": ps.get_expert_model_parallel_group()}
        ctx = SimpleNamespace(rank=dist.get_rank(), groups=groups)
        with contracts.probes_installed(), checked_region(ctx) as found, harness_code(str(ENTRY_SCRIPT)):
            result = train_step(*args, **kwargs)
        for violation in found:
            if violation["line"] not in self.violations:
                self.violations.append(violation["line"])
        return result

    def _wrap_setup(self, setup: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            model, optimizer, scheduler = setup(*args, **kwargs)
            self.layers = check_built_model(model)  # the flags' model, or one line and stop
            if os.environ.get(SAVE_INIT_ENV):
                save_initial_weights(model, optimizer, scheduler, os.environ[SAVE_INIT_ENV])
            self.model = list(model)
            optimizer.step = self._wrap_optimizer_step(optimizer.step)
            self._hook_routers()
            return model, optimizer, scheduler

        return recorded

    def _wrap_optimizer_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.grads_seen(self.model)
            return step(*args, **kwargs)

        return recorded

    def _hook_routers(self) -> None:
        try:
            from megatron.core.transformer.moe.router import TopKRouter
        except ImportError:  # pragma: no cover - every supported release has it
            return
        for chunk in self.model:
            for name, module in _global_names(chunk, modules=True):
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._count_tokens(name))

    def _count_tokens(self, name: str) -> Callable[..., None]:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            routing_map = output[1]
            counts = routing_map.reshape(-1, routing_map.shape[-1]).sum(0).tolist()
            known = self.token_counts.setdefault(name, [0] * len(counts))
            self.token_counts[name] = [a + int(b) for a, b in zip(known, counts, strict=True)]

        return hook


def save_initial_weights(model: Any, optimizer: Any, scheduler: Any, folder: str) -> None:
    """Save the weights before the first step with Megatron's own ``save_checkpoint`` (iteration 0),
    for a run in another layout to start from (``--load folder --finetune``). The optimizer's
    state is left out, as the other run loads none: the distributed optimizer's state dict
    asserts one step count over its state, which it has none of before the first step."""
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint

    args = get_args()
    with patched_attrs([(args, "save", folder), (args, "no_save_optim", True)]):
        save_checkpoint(0, model, optimizer, scheduler, 0)


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _rank_meta() -> dict[str, Any]:
    """Which shard of parameters and tokens this rank holds."""
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    args = get_args()
    tp = ps.get_tensor_model_parallel_rank()
    return {"tp": tp, "etp": ps.get_expert_tensor_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "token_shard": [ps.get_data_parallel_rank(), ps.get_context_parallel_rank(),
                            tp if args.sequence_parallel else 0],
            "distributed_optimizer": bool(args.use_distributed_optimizer)}


def _global_names(chunk: Any, modules: bool = False) -> list[tuple[str, Any]]:
    """(global name, parameter or module) of a model chunk: layer and expert indices global.

    Pipeline stages number their layers from 0 and expert-parallel ranks their experts; the
    global name uses each layer's ``layer_number`` and each expert's global index, so that a
    name means the same tensor in every layout.
    """
    items = chunk.named_modules() if modules else chunk.named_parameters()
    return [(_global_name(chunk, name, modules), item) for name, item in items]


def _global_name(chunk: Any, name: str, is_module: bool) -> str:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    parts = name.split(".") if name else []
    path = parts if is_module else parts[:-1]
    out: list[str] = []
    parent, module = None, chunk
    for part in path:
        child = module[int(part)] if part.isdigit() else getattr(module, part)
        if part.isdigit() and isinstance(child, TransformerLayer):
            part = str(child.layer_number - 1)
        elif part.isdigit() and out and out[-1] == "local_experts":
            part = str(parent.ep_group.rank() * parent.num_local_experts + int(part))
        out.append(part)
        parent, module = module, child
    name = ".".join(out + ([] if is_module else parts[-1:]))
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _param_sums(model: list[Any]) -> dict[str, list[Any]]:
    """Global parameter name -> [shard key, sum of squares, exact zeros, rounding-sized entries]
    of its gradient on this rank (rounding-sized: at most 2**-20 of the largest entry)."""
    from megatron.core import parallel_state as ps

    sums: dict[str, list[Any]] = {}
    for chunk in model:
        for name, param in _global_names(chunk):
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is None:
                continue
            shard = ""
            if getattr(param, "tensor_model_parallel", False):
                expert = not getattr(param, "allreduce", True)
                rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
                shard = f"{'e' if expert else ''}tp{rank}"
            if hasattr(grad, "to_local"):  # torch FSDP2's gradient: this data-parallel rank's share of it
                grad = grad.to_local()
                shard += f"fsdp{ps.get_data_parallel_rank(with_context_parallel=True)}"
            size = grad.detach().abs()
            tiny = int((size <= size.max() * 2.0 ** -20).sum()) if size.numel() else 0
            sums[name] = [shard, float(grad.double().pow(2).sum()), int((grad == 0).sum()), tiny]
    return sums


def record_folder() -> Path | None:
    """The folder this rank records into, when the parent asked for a record."""
    folder = os.environ.get(RECORD_ENV)
    return Path(folder) if folder else None
