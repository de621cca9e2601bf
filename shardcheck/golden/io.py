"""Load Megatron golden-value files into per-metric step series, or reject them in one line."""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

INFERENCE_KEYS = frozenset(
    {"generated_text", "generated_tokens", "logprobs", "input_prompt", "latency", "throughput"}
)
NAN_STRINGS = frozenset({"nan", "NaN", "inf", "-inf", "Infinity", "-Infinity"})


class GoldenInputError(Exception):
    """An input that shardcheck cannot use; the message is one line that says why."""


@dataclass(frozen=True)
class MetricSeries:
    """One metric of one run: sorted steps, float values, and which values were strings.

    A string value (Megatron writes ``"nan"`` for steps it has no number for) is stored as
    NaN in ``values`` and flagged in ``text``, because Megatron's CI treats it differently
    from a real floating-point NaN.
    """

    name: str
    steps: np.ndarray
    values: np.ndarray
    text: np.ndarray

    def finite(self) -> tuple[np.ndarray, np.ndarray]:
        """Steps and values where the value is a finite number."""
        keep = np.isfinite(self.values)
        return self.steps[keep], self.values[keep]

    def after(self, step: int) -> MetricSeries:
        """The part of the series strictly after ``step``."""
        return self.select(self.steps > step)

    def until(self, step: int) -> MetricSeries:
        """The part of the series up to and including ``step``."""
        return self.select(self.steps <= step)

    def select(self, mask: np.ndarray) -> MetricSeries:
        """The steps where ``mask`` is true."""
        return MetricSeries(self.name, self.steps[mask], self.values[mask], self.text[mask])


@dataclass(frozen=True)
class GoldenFile:
    """A training-format golden-values file: metric name -> series."""

    source: str
    metrics: dict[str, MetricSeries]
    legacy: bool = False
    notes: tuple[str, ...] = field(default=())


def load_golden(path: str | Path) -> GoldenFile:
    """Read and validate one golden-values file; raise GoldenInputError with a one-line reason."""
    return parse_golden(read_text(path), str(path))


def tokens_path(path: str | Path) -> Path:
    """Where the tokens per expert beside the golden file ``path`` are (``shardcheck train``)."""
    path = Path(path)
    return path.with_name(path.stem + ".tokens.json")


def load_expert_tokens(path: str | Path) -> dict[int, dict[str, list[int]]]:
    """Step -> router -> tokens each expert received, from the file beside golden ``path``;
    empty when there is none (CI's files have none)."""
    beside = tokens_path(path)
    if not beside.is_file():
        return {}
    try:
        doc = json.loads(read_text(beside))
        return {int(step): {router: [int(c) for c in counts] for router, counts in routers.items()}
                for step, routers in doc.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise GoldenInputError(f"{beside}: not a tokens-per-expert file ({exc})") from exc


def read_text(path: str | Path) -> str:
    """A text file's contents; GoldenInputError with the reason if it can't be read."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise GoldenInputError(f"{path}: cannot read ({reason})") from None


def parse_golden(text: str, source: str) -> GoldenFile:
    """Parse golden-values JSON text (``source`` names it in messages)."""
    if not text.strip():
        raise GoldenInputError(f"{source}: empty file, no golden values in it")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise GoldenInputError(
            f"{source}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from None
    if not isinstance(doc, dict):
        raise GoldenInputError(
            f"{source}: top level is a JSON {type(doc).__name__}, expected an object of metrics"
        )
    if not doc:
        raise GoldenInputError(f"{source}: empty object {{}}, the file records no metrics")
    if _looks_like_inference(doc):
        raise GoldenInputError(
            f"{source}: inference golden values (generated tokens/logprobs per request), "
            "not a training-metrics file"
        )
    return _parse_training(doc, source)


def _looks_like_inference(doc: Mapping) -> bool:
    if INFERENCE_KEYS & doc.keys():
        return True
    return any(isinstance(v, dict) and INFERENCE_KEYS & v.keys() for v in doc.values())


def _parse_training(doc: Mapping, source: str) -> GoldenFile:
    metrics: dict[str, MetricSeries] = {}
    notes: list[str] = []
    legacy = False
    for name, block in doc.items():
        if not isinstance(block, dict):
            notes.append(
                f"ignored top-level entry {name!r} (a {type(block).__name__}, not a series)"
            )
            continue
        if "values" not in block:
            raise GoldenInputError(f"{source}: metric {name!r} has no 'values'")
        if isinstance(block["values"], list):
            legacy = True
        metrics[name] = _parse_metric(name, block, source)
    if not metrics:
        raise GoldenInputError(f"{source}: no metric series (objects with 'values') in the file")
    if legacy:
        notes.insert(0, "legacy format: list values placed at start_step + i * step_interval")
    return GoldenFile(source, metrics, legacy, tuple(notes))


def _parse_metric(name: str, block: Mapping, source: str) -> MetricSeries:
    raw = block["values"]
    where = f"{source}: metric {name!r}"
    if isinstance(raw, list):
        steps = [s for s, _ in _legacy_pairs(raw, block, where)]
        values = raw
    elif isinstance(raw, dict):
        steps = _steps(list(raw), where)
        values = list(raw.values())
    else:
        raise GoldenInputError(f"{where}: 'values' is a {type(raw).__name__}, expected an object")
    step_array = np.asarray(steps, dtype=np.int64)
    order = np.argsort(step_array, kind="stable")
    sorted_steps = step_array[order]
    if np.any(np.diff(sorted_steps) == 0):
        raise GoldenInputError(f"{where}: a step appears twice")
    numbers, text = _numbers(values, steps, where)
    return MetricSeries(name, sorted_steps, numbers[order], text[order])


def _numbers(values: list, steps: list[int], where: str) -> tuple[np.ndarray, np.ndarray]:
    """Values as floats (NaN for strings) and the mask of string values."""
    kinds = Counter(map(type, values))
    if kinds.keys() <= {int, float}:
        return np.array(values, dtype=np.float64), np.zeros(len(values), dtype=bool)
    if kinds.keys() <= {int, float, str}:
        fast = _nan_strings_fast(values, kinds[str])
        if fast is not None:
            return fast
    numbers = np.array(
        [_number(v, s, where) for s, v in zip(steps, values, strict=True)], dtype=np.float64
    )
    return numbers, np.array([isinstance(v, str) for v in values], dtype=bool)


def _nan_strings_fast(values: list, n_strings: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Numbers and string mask when every string is "nan"/"NaN"; None to take the slow path."""
    try:
        numbers = np.array(values, dtype=np.float64)
    except ValueError:
        return None
    text = np.zeros(len(values), dtype=bool)
    nan_at = np.flatnonzero(np.isnan(numbers))
    text[nan_at] = [type(values[i]) is str for i in nan_at]
    return (numbers, text) if int(text.sum()) == n_strings else None


def _legacy_pairs(raw: list, block: Mapping, where: str) -> list[tuple[int, object]]:
    start, interval = block.get("start_step"), block.get("step_interval")
    if not isinstance(start, int) or not isinstance(interval, int) or interval <= 0:
        raise GoldenInputError(f"{where}: list values need integer start_step and step_interval")
    return [(start + i * interval, value) for i, value in enumerate(raw)]


@functools.lru_cache(maxsize=512)
def _regular_keys(start: int, count: int, interval: int) -> list[str]:
    return [str(step) for step in range(start, start + count * interval, interval)]


def _steps(keys: list, where: str) -> np.ndarray:
    """Step keys as integers; evenly spaced keys (after an optional first) take a fast path."""
    if len(keys) >= 3 and all(k.isdigit() for k in keys[:3]):
        second, interval = int(keys[1]), int(keys[2]) - int(keys[1])
        if interval > 0 and keys[1:] == _regular_keys(second, len(keys) - 1, interval):
            rest = np.arange(second, second + (len(keys) - 1) * interval, interval, dtype=np.int64)
            return np.concatenate([[int(keys[0])], rest]).astype(np.int64)
    try:
        return np.fromiter(map(int, keys), dtype=np.int64, count=len(keys))
    except ValueError:
        bad = next(k for k in keys if not k.strip().lstrip("-").isdigit())
        raise GoldenInputError(f"{where}: step key {bad!r} is not an integer") from None


def _number(value: object, step: int, where: str) -> float:
    if isinstance(value, bool):
        raise GoldenInputError(f"{where}: step {step} holds a boolean, expected a number")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        if value in NAN_STRINGS:
            return math.nan
        raise GoldenInputError(f"{where}: step {step} holds the string {value!r}, not a number")
    raise GoldenInputError(f"{where}: step {step} holds a {type(value).__name__}, not a number")
