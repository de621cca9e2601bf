"""Attribute num-zeros jumps to whole parameter blocks (e.g. experts whose gradient is all zero).

Megatron's ``num-zeros`` counts zero entries of the gradients of all parameters. When an
expert receives no tokens at a step, every entry of its weight gradient is zero, so the
count jumps by exactly one expert's size. From the model config we list candidate block
sizes, pick the largest one whose whole multiples explain the jumps, and split each
step's count into ``k`` whole blocks plus a residual baseline.

Where the tokens each expert received are known (``shardcheck train`` writes them beside its
golden files), the block is one expert, and each step names the experts that received none,
on each side: a step's whole blocks should be its idle experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardcheck.golden.config import ModelConfig
from shardcheck.golden.io import GoldenInputError, MetricSeries
from shardcheck.golden.stats import MetricComparison, compare_metric, paired_steps

FIT_RESIDUAL = 0.10
FIT_SHARE = 0.80
ONE_EXPERT = "one expert (fc1 + fc2)"


@dataclass(frozen=True)
class Block:
    """A candidate parameter block: name, number of values, and how it was computed."""

    name: str
    size: int
    formula: str


@dataclass(frozen=True)
class StepBlocks:
    """One step split into whole blocks plus a residual, on both sides."""

    step: int
    old: float
    new: float
    old_blocks: int
    new_blocks: int

    def residuals(self, size: int) -> tuple[float, float]:
        return self.old - self.old_blocks * size, self.new - self.new_blocks * size


Tokens = dict[int, dict[str, list[int]]]  # step -> router -> tokens each expert received


@dataclass(frozen=True)
class IdleExperts:
    """One step's experts that received no tokens, per router, in old and new."""

    step: int
    old: dict[str, tuple[int, ...]]
    new: dict[str, tuple[int, ...]]

    def counts(self) -> tuple[int, int]:
        return sum(map(len, self.old.values())), sum(map(len, self.new.values()))


@dataclass(frozen=True)
class Explanation:
    """The chosen block, the per-step split, how the residual baseline moved, and (where the
    tokens per expert are known) each step's idle experts."""

    metric: str
    candidates: tuple[Block, ...]
    block: Block | None
    steps: tuple[StepBlocks, ...]
    residual: MetricComparison | None
    poor_fit: tuple[int, ...]
    idle: tuple[IdleExperts, ...] | None = None  # None: no tokens per expert on both sides

    def changed(self) -> list[StepBlocks]:
        """Steps whose whole-block count differs between old and new."""
        return [s for s in self.steps if s.old_blocks != s.new_blocks]

    def unexplained_by_idle_experts(self) -> list[StepBlocks]:
        """With one expert as the block: steps whose whole blocks are not their idle experts."""
        idle = {i.step: i.counts() for i in self.idle or ()}
        return [s for s in self.steps if (s.old_blocks, s.new_blocks) != idle.get(s.step, (0, 0))]


def idle_experts(old: Tokens, new: Tokens, steps: np.ndarray) -> tuple[IdleExperts, ...]:
    """Each of ``steps`` where an expert received no tokens in old or new."""
    found = []
    for step in map(int, steps):
        sides = [{router: tuple(e for e, n in enumerate(counts) if n == 0)
                  for router, counts in tokens.get(step, {}).items()} for tokens in (old, new)]
        sides = [{router: idle for router, idle in side.items() if idle} for side in sides]
        if any(sides):
            found.append(IdleExperts(step, *sides))
    return tuple(found)


def candidate_blocks(config: ModelConfig) -> list[Block]:
    """Parameter blocks of one layer, largest first, from the model config's sizes."""
    hidden = config.arg_int("--hidden-size")
    if not hidden:
        raise GoldenInputError(f"{config.source}: no --hidden-size, cannot size parameter blocks")
    ffn = config.arg_int("--ffn-hidden-size", 4 * hidden)
    moe_ffn = config.arg_int("--moe-ffn-hidden-size", ffn)
    experts = config.arg_int("--num-experts", 0)
    glu = 2 if config.arg_flag("--swiglu") else 1
    blocks = []
    if not experts or config.model_args.get("--moe-layer-freq"):
        blocks.append(_mlp_block("dense MLP", hidden, ffn, glu))
    if experts:
        blocks += _expert_blocks(config, hidden, moe_ffn, glu, experts)
    shared = config.arg_int("--moe-shared-expert-intermediate-size", 0)
    if shared:
        blocks.append(_mlp_block("shared expert", hidden, shared, glu))
    return _dedupe(sorted(blocks, key=lambda b: -b.size))


def _mlp_block(name: str, hidden: int, ffn: int, glu: int) -> Block:
    fc1 = f"{hidden}x{glu}*{ffn}" if glu > 1 else f"{hidden}x{ffn}"
    return Block(name, hidden * ffn * glu + ffn * hidden, f"{fc1} + {ffn}x{hidden}")


def _expert_blocks(
    config: ModelConfig, hidden: int, ffn: int, glu: int, experts: int
) -> list[Block]:
    expert = _mlp_block(ONE_EXPERT, hidden, ffn, glu)
    tp = config.arg_int("--tensor-model-parallel-size", 1) or 1
    ep = config.arg_int("--expert-model-parallel-size", 1) or 1
    etp = config.arg_int("--expert-tensor-parallel-size", tp) or 1
    blocks = [
        expert,
        Block("expert fc1", hidden * ffn * glu, expert.formula.split(" + ")[0]),
        Block("expert fc2", ffn * hidden, f"{ffn}x{hidden}"),
        Block("router", hidden * experts, f"{hidden}x{experts}"),
    ]
    if experts // ep > 1:
        local = experts // ep
        blocks.append(
            Block(f"experts of one EP rank ({local})", local * expert.size, f"{local} x expert")
        )
    if etp > 1:
        blocks.append(
            Block(f"expert shard of one ETP rank (1/{etp})", expert.size // etp, f"expert / {etp}")
        )
    return blocks


def _dedupe(blocks: list[Block]) -> list[Block]:
    seen: dict[int, Block] = {}
    for block in blocks:
        seen.setdefault(block.size, block)
    return list(seen.values())


def explain_num_zeros(old: MetricSeries, new: MetricSeries, config: ModelConfig,
                      old_tokens: Tokens | None = None, new_tokens: Tokens | None = None) -> Explanation:
    """Split each shared step of two num-zeros series into whole blocks plus a residual;
    with both sides' tokens per expert, name each step's idle experts."""
    candidates = candidate_blocks(config)
    pair = paired_steps(old, new, skip_zero_old=False)  # a count of 0 is a value here: no idle expert
    idle = idle_experts(old_tokens, new_tokens, pair.steps) if old_tokens and new_tokens else None
    values = np.concatenate([pair.old, pair.new])
    block = best_block(values, candidates)
    if idle is not None:  # the tokens say how many experts each step left idle: one expert is the block
        block = next((b for b in candidates if b.name == ONE_EXPERT), block)
    if block is None:
        return Explanation(old.name, tuple(candidates), None, (), None, (), idle)
    size = block.size
    steps = tuple(
        StepBlocks(int(s), float(o), float(n), int(o // size), int(n // size))
        for s, o, n in zip(pair.steps, pair.old, pair.new, strict=True)
    )
    poor = tuple(s.step for s in steps if not _fits_all(s, size))
    residual = compare_metric(
        _residual_series(old.name, steps, size, 0), _residual_series(old.name, steps, size, 1)
    )
    return Explanation(old.name, tuple(candidates), block, steps, residual, poor, idle)


def best_block(values: np.ndarray, candidates: list[Block]) -> Block | None:
    """The block whose whole multiples explain the most steps (larger wins ties), or None.

    A block qualifies when the median value is below half a block (typical steps hold no
    whole block) and at least 80 % of the steps holding one or more blocks leave a residual
    under 10 % of a block.
    """
    baseline = float(np.median(values)) if len(values) else 0.0
    best, best_score = None, 0
    for block in candidates:
        counts = values // block.size
        holding = counts >= 1
        if baseline >= 0.5 * block.size or not holding.any():
            continue
        fits = values[holding] - counts[holding] * block.size <= FIT_RESIDUAL * block.size
        if np.mean(fits) >= FIT_SHARE and fits.sum() > best_score:
            best, best_score = block, int(fits.sum())
    return best


def _fits_all(step: StepBlocks, size: int) -> bool:
    return all(
        r <= FIT_RESIDUAL * size
        for r, k in zip(step.residuals(size), (step.old_blocks, step.new_blocks), strict=True)
        if k
    )


def _residual_series(
    name: str, steps: tuple[StepBlocks, ...], size: int, side: int
) -> MetricSeries:
    values = np.array([s.residuals(size)[side] for s in steps], dtype=np.float64)
    step_numbers = np.array([s.step for s in steps], dtype=np.int64)
    return MetricSeries(f"{name} residual", step_numbers, values, np.zeros(len(steps), dtype=bool))
