"""Compare an N-rank training run with its one-rank run, step by step.

``lm loss`` and ``grad norm`` must agree at every step within a relative tolerance that grows
with the step: both runs start from the same weights and data, and only the order of
floating-point sums differs between layouts, whose rounding the optimizer carries forward.
A parameter's gradient norm must agree too; its absolute floor is a fraction of the step's
whole gradient norm, so that a gradient that is zero by construction (only rounding on either
side) does not count. ``num-zeros`` is compared but does not decide: a gradient entry that
is mathematically zero can round to an exact zero in one layout and not in the other; such a
difference is reported with the parameters that explain it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardcheck.train.records import Run, Step

FLOAT32_EPS = 2.0 ** -23
# Machine epsilons of the half precisions a run may train in (TE's context-parallel attention
# takes nothing else).
HALF_EPS = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}
DECIDING = ("lm loss", "grad norm")


@dataclass(frozen=True)
class Tolerance:
    """Relative tolerance ``rtol * (1 + growth * (step - 1))``; parameters use ``param_rtol``."""

    rtol: float = 256 * FLOAT32_EPS
    growth: float = 4.0
    param_rtol: float = 4096 * FLOAT32_EPS
    param_floor: float = 1e-5  # fraction of the step's grad norm below which a norm is rounding

    def at(self, step: int, base: float) -> float:
        return base * (1.0 + self.growth * (step - 1))

    @classmethod
    def for_precision(cls, precision: str) -> Tolerance:
        """The default for runs that train in ``precision`` (fp32, bf16 or fp16).

        In half precision the activations round at ``eps``, and the layouts round differently
        (TE's ring attention merges per-chunk softmaxes): the metrics get ``eps / 4``, a
        parameter's norm ``eps``. TE's GPT at tp2 cp2 in bf16 stays 8x inside them at step 1
        (lm loss 6e-6, grad norm 2.3e-4, worst parameter 9.4e-4; docs/train.md).
        """
        if precision not in HALF_EPS:
            return cls()
        eps = HALF_EPS[precision]
        return cls(rtol=eps / 4, param_rtol=eps)


@dataclass(frozen=True)
class Divergence:
    """Where two runs first part ways: the step, the metric (or parameter) and both values."""

    step: int
    name: str
    value: float | None
    reference: float | None
    tol: float

    def describe(self) -> str:
        rel = _rel(self.value, self.reference)
        return (f"step {self.step}, {self.name}: {_num(self.value)} vs one rank {_num(self.reference)}"
                f" (rel diff {_num(rel)}, tol {self.tol:.1e})")


@dataclass
class TrainVerdict:
    """The comparison of a run with its reference, per step, and what decided it."""

    steps: int
    worst: dict[str, float] = field(default_factory=dict)  # metric -> largest relative difference
    metric: Divergence | None = None
    parameter: Divergence | None = None
    zero_notes: list[str] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        return self.metric is None and self.parameter is None

    @property
    def exact(self) -> bool:
        """Whether lm loss and grad norm are equal at every step (a resumed CPU run's promise)."""
        return all(self.worst.get(name, 0.0) == 0.0 for name in DECIDING)

    def lines(self) -> list[str]:
        out = [f"compared {self.steps} steps: " + ", ".join(
            f"{name} max rel diff {_num(value)}" for name, value in self.worst.items())]
        if self.metric:
            out.append(f"first metric to part ways: {self.metric.describe()}")
        if self.parameter:
            out.append(f"first parameter to part ways: {self.parameter.describe()}")
        out += self.zero_notes
        out.append("verdict: AGREE" if self.agree else "verdict: DIFFER")
        return out


def compare_runs(run: Run, reference: Run, tolerance: Tolerance | None = None) -> TrainVerdict:
    """Compare ``run`` with ``reference`` step by step; the first divergences are named."""
    tol = tolerance or Tolerance()
    verdict = TrainVerdict(min(len(run.steps), len(reference.steps)))
    for mine, ref in zip(run.steps, reference.steps, strict=False):
        for name in DECIDING:
            value, expected = mine.metrics.get(name), ref.metrics.get(name)
            rel = _rel(value, expected)
            verdict.worst[name] = max(verdict.worst.get(name, 0.0), rel)
            if verdict.metric is None and not rel <= tol.at(mine.step, tol.rtol):
                verdict.metric = Divergence(mine.step, name, value, expected, tol.at(mine.step, tol.rtol))
        if verdict.parameter is None:
            verdict.parameter = _first_parameter(mine, ref, tol)
        note = _zeros_note(mine, ref, tol)
        if note:
            verdict.zero_notes.append(note)
    if len(run.steps) != len(reference.steps):
        verdict.metric = verdict.metric or Divergence(
            verdict.steps + 1, "steps run", len(run.steps), len(reference.steps), 0.0)
    return verdict


def _first_parameter(mine: Step, ref: Step, tol: Tolerance) -> Divergence | None:
    floor = tol.param_floor * (ref.metrics.get("grad norm") or 0.0)
    rtol = tol.at(mine.step, tol.param_rtol)
    for name in ref.param_norms:
        value, expected = mine.param_norms.get(name), ref.param_norms[name]
        if value is None:
            if mine.param_norms:
                return Divergence(mine.step, f"gradient norm of {name} (missing)", None, expected, rtol)
            continue
        if abs(value - expected) > max(rtol * abs(expected), floor):
            return Divergence(mine.step, f"gradient norm of {name}", value, expected, rtol)
    return None


def rounding_zero_params(step: Step, tol: Tolerance) -> list[str]:
    """Parameters whose gradient is zero up to rounding at this step: zero by construction."""
    floor = tol.param_floor * (step.metrics.get("grad norm") or 0.0)
    return [name for name, norm in step.param_norms.items() if norm <= floor]


def _zeros_note(mine: Step, ref: Step, tol: Tolerance) -> str | None:
    value, expected = mine.metrics.get("num-zeros"), ref.metrics.get("num-zeros")
    if value is None or expected is None or value == expected:
        return None
    rounding = sorted(set(rounding_zero_params(mine, tol)) | set(rounding_zero_params(ref, tol)))
    idle = idle_experts(mine) ^ idle_experts(ref)
    why = []
    if idle:
        why.append("experts with no tokens in one run only (their whole gradients are zero): "
                   + ", ".join(f"{router} expert {e}" for router, e in sorted(idle)))
    if rounding:
        why.append(f"rounding in gradients that are zero by construction: {', '.join(rounding)}")
    moved = _zeros_moved(mine, ref)
    if moved:
        why.append("exact zeros moved in " + ", ".join(moved))
    if not why:
        why.append("no expert went idle and no parameter's gradient is zero up to rounding")
    return f"step {mine.step}: num-zeros {value:g} vs one rank {expected:g}; {'; '.join(why)}"


def _zeros_moved(mine: Step, ref: Step) -> list[str]:
    """Parameters whose exact-zero count differs, each said to be rounding when the other run
    has at least as many rounding-sized entries there (a gradient entry zero by construction)."""
    out = []
    for name, (zeros, tiny) in mine.param_zeros.items():
        ref_zeros, ref_tiny = ref.param_zeros.get(name, (zeros, tiny))
        if zeros != ref_zeros:
            rounding = zeros <= ref_tiny and ref_zeros <= tiny
            out.append(f"{name} ({zeros} vs {ref_zeros}{', rounding zeros' if rounding else ''})")
    return out


def idle_experts(step: Step) -> set[tuple[str, int]]:
    """(router, expert) pairs that received no token at this step."""
    return {(router, e) for router, counts in step.tokens_per_expert.items()
            for e, count in enumerate(counts) if count == 0}


def _rel(value: float | None, expected: float | None) -> float:
    if value is None or expected is None:
        return 0.0 if value is expected else math.inf
    if math.isnan(value) or math.isnan(expected):
        return 0.0 if math.isnan(value) and math.isnan(expected) else math.inf
    return abs(value - expected) / max(abs(expected), 1e-30)


def _num(value: float | None) -> str:
    return "none" if value is None else f"{value:.6g}"
