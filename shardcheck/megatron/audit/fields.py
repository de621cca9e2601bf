"""The discrete configuration space of megatron-core, read from its config dataclasses.

:func:`config_choices` introspects ``TransformerConfig`` (which extends ``ModelParallelConfig``)
and lists every field whose values form a small finite set: booleans, enums and ``Literal``
types (``Optional`` adds ``None``). Numbers, callables and sizes are left to the scenarios.

Not every value runs on a CPU. :func:`probe` tries one value on the one-rank tiny GPT train
step and says what happened: ``"runs"``, ``"invalid"`` (Megatron's own config validation
rejects the value on its own: it needs another field too) or ``"needs-gpu"`` (the error names
CUDA, Transformer Engine, Apex, Triton or a fused kernel). :data:`KNOWN_CPU_BLOCKERS` names the
families of fields that need a GPU and why; ``python -m shardcheck.megatron.audit.fields`` probes them
all and prints the table.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import sys
import typing
from dataclasses import dataclass
from typing import Any, Literal

from shardcheck.megatron.audit.annotations import literal_values, members, type_hints, unique

# Field-name patterns whose non-default values need a GPU-only implementation.
KNOWN_CPU_BLOCKERS: dict[str, str] = {
    r"^fp8|^fp4|_fp8|fp8_": "FP8/FP4 need Transformer Engine and Hopper/Blackwell GPUs",
    r"^tp_comm_|^cuda_graph|_cuda_graph|^use_te_|^te_": "Transformer Engine userbuffers / CUDA graphs",
    r"fusion$|_fusion_|^persist_layer_norm|^memory_efficient_layer_norm":
        "fused CUDA/Triton kernels or Apex (fused RoPE, bias-activation, cross-entropy, norms)",
    r"^gradient_accumulation_fusion": "needs Apex/TE fused wgrad accumulation (CUDA)",
    r"deepep|hybridep|^moe_flex|^moe_grouped_gemm|^moe_use_legacy_grouped_gemm":
        "MoE GPU kernels (DeepEP, grouped GEMM)",
    r"^cpu_offloading|^fine_grained_activation_offloading|^offload_":
        "activation offloading moves tensors between CUDA and pinned host memory",
    r"^symmetric_ar_type|^nccl|^use_sharp": "NCCL-only collectives",
}

GPU_ERROR = re.compile(
    r"(?i:cuda|transformer[_ ]engine|apex|triton|fused|nvte|kitchen|flash|deep_?ep|"
    r"grouped_gemm|mamba|causal_conv1d)|\bTE\b")


@dataclass(frozen=True)
class FieldChoice:
    """A config field with a finite set of values."""

    name: str
    owner: str
    default: Any
    values: tuple

    def alternatives(self) -> tuple:
        """The values other than the default."""
        return tuple(v for v in self.values if v != self.default)


def _finite_values(hint: Any) -> tuple | None:
    """Every value of a bool, enum or Literal annotation (``None`` too when optional), else None."""
    values: list[Any] = []
    for member in members(hint):
        if member is type(None):
            continue
        if member is bool:
            values += [False, True]
        elif isinstance(member, type) and issubclass(member, enum.Enum):
            values += list(member)
        elif typing.get_origin(member) is Literal:
            values += literal_values(member)
        else:
            return None
    if not values:
        return None
    return (*unique(values), *([None] if type(None) in members(hint) else []))


def config_choices() -> list[FieldChoice]:
    """Every boolean, enum or Literal field of TransformerConfig and ModelParallelConfig."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    hints = type_hints(TransformerConfig)
    parallel = {f.name for f in dataclasses.fields(ModelParallelConfig)}
    choices = []
    for f in dataclasses.fields(TransformerConfig):
        if f.name.startswith("_"):
            continue
        values = _finite_values(hints[f.name])
        if values is None:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        owner = "ModelParallelConfig" if f.name in parallel else "TransformerConfig"
        choices.append(FieldChoice(f.name, owner, default, values))
    return choices


def known_blocker(name: str) -> str | None:
    """Why a field's non-default values need a GPU, if it is in a known family."""
    return next((why for pattern, why in KNOWN_CPU_BLOCKERS.items() if re.search(pattern, name)),
                None)


def classify(error: BaseException | None) -> str:
    """'runs', 'invalid' (rejected by config validation) or 'needs-gpu' from a probe's outcome."""
    if error is None:
        return "runs"
    text = f"{type(error).__name__}: {error}"
    if GPU_ERROR.search(text) or isinstance(error, ImportError | ModuleNotFoundError):
        return "needs-gpu"
    return "invalid"


def probe(name: str, value: Any) -> tuple[str, str]:
    """Run the one-rank tiny GPT train step with ``name=value``: (verdict, last error line).

    Call on a rank with a one-rank Gloo process group (e.g. inside ``spawn_ranks(fn, 1)``).
    """
    from shardcheck.megatron.cpu.runner import RankContext
    from shardcheck.megatron.scenarios.gpt import GPTSetup, train_step
    from shardcheck.parity.layout import Layout

    setup = GPTSetup(layers=1, seq=8, microbatches=1, micro_batch=1, optimizer_step=False,
                     config={name: value})
    environment = dict(os.environ)  # some config values export NVTE_* variables
    try:
        train_step(RankContext(Layout(), 0), setup)
    except Exception as exc:  # noqa: BLE001 - any failure is the probe's answer
        message = str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else ""
        return classify(exc), f"{type(exc).__name__}: {message}"
    finally:
        os.environ.clear()
        os.environ.update(environment)
    return "runs", ""


def probe_all(choices: list[FieldChoice] | None = None) -> list[tuple[str, Any, str, str]]:
    """Probe every alternative value of every choice: (field, value, verdict, error)."""
    rows = []
    for choice in choices if choices is not None else config_choices():
        for value in choice.alternatives():
            rows.append((choice.name, value, *probe(choice.name, value)))
    return rows


def _main() -> None:  # pragma: no cover - a one-off table for the docs
    from shardcheck.parity.launch import spawn_ranks

    rows = spawn_ranks(probe_all, 1, timeout=1800)[0]
    for name, value, verdict, error in rows:
        print(f"{verdict:9} {name}={value!r} {error}")
    sys.stdout.flush()


if __name__ == "__main__":
    _main()
