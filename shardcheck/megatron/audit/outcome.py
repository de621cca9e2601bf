"""What one audit case gave (:class:`Outcome`), and how a rank's failure reads: a refusal by
megatron-core's argument checks, a crash, and where in megatron-core it happened."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shardcheck.megatron.audit.divergence import CallGap, Gap
from shardcheck.megatron.audit.sweep import Case
from shardcheck.megatron.checks.paths import megatron_path
from shardcheck.megatron.cpu.parallel import LayoutUnsupported
from shardcheck.parity.pool import PoolFailure

CONFIG_REFUSES = "megatron-core refuses it"


@dataclass
class Outcome:
    """What one case gave: nothing wrong, gaps (numeric), violations (types), or an error."""

    case: Case
    gaps: list[Gap] = field(default_factory=list)
    call_gap: CallGap | None = None
    violations: list[dict] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    error_kind: str | None = None
    entry: str | None = None
    errors: dict[str, float] = field(default_factory=dict)
    reference_digest: str | None = None  # the one-rank outputs' hash: which options change them
    frame: str | None = None  # an error's innermost megatron-core frame
    config_check: bool = False  # megatron-core's check of its arguments raised it
    ops: dict | None = None  # op calls in megatron-core over all ranks: typed, unknown, unknown_at
    declared: dict[str, str] = field(default_factory=dict)  # parameters' tp declarations, by key
    in_megatron: bool = False  # the exception was raised in megatron-core's own code

    @property
    def one_rank_crash(self) -> bool:
        """It raised on one rank (its reference, at ``Layout()``) in megatron-core's own code,
        not refusing its arguments: a megatron-core bug that needs no layout."""
        return (self.case.layout.world_size == 1 and self.error_kind == "error" and self.in_megatron
                and self.refusal is None and not self.missing_code)

    @property
    def missing_code(self) -> bool:
        """It raised because this machine lacks code it needs (:data:`MISSING_CODE`): an option
        that cannot run here, not a megatron-core bug."""
        return self.error_kind == "error" and bool(MISSING_CODE.search(self.error or ""))

    @property
    def crashed(self) -> bool:
        """It raised (or hung) under its layout while its one-rank reference ran, not for want
        of code this machine lacks."""
        return bool(self.error) and self.refusal is None and not self.missing_code

    @property
    def failed(self) -> bool:
        return bool(self.gaps or self.violations)

    @property
    def refusal(self) -> str | None:
        """Why the scenario (``LayoutUnsupported``) or megatron-core's check of its arguments
        (:func:`_in_config_check`) refused the case on its ranks, else None."""
        if self.error and self.error.split(":")[0].endswith(LayoutUnsupported.__name__):
            return self.error.split(":", 1)[1].strip()
        if self.error and self.config_check:
            return f"{CONFIG_REFUSES}: {self.error}" + (f" ({self.frame})" if self.frame else "")
        return None

    @classmethod
    def raised(cls, case: Case, failure: PoolFailure, **known: Any) -> Outcome:
        """The outcome of a case whose ranks raised, hung or desynced: the error's line, kind and
        innermost megatron-core frame, and whether megatron-core's argument checks raised it."""
        return cls(case, error=first_line(failure), error_kind=failure.kind, frame=_megatron_frame(failure),
                   config_check=_in_config_check(failure, option_fields(case)), in_megatron=_raised_in_megatron(failure),
                   **known)


_FRAME = re.compile(r'^ +File "([^"]*)", line \d+, in (\S+)', re.MULTILINE)
_MEGATRON = "/megatron/core/"
REFUSED_TYPES = ("AssertionError", "ValueError")  # Python's exceptions for a refused argument
CONSTRUCTORS = ("__init__", "__new__", "__post_init__")  # __new__: WrappedTorchNorm's checks
# megatron-core saying that code it needs is not installed (a CUDA extension, Apex), or calling
# a function this PyTorch lacks (``torch.distributed.ring_exchange``, in NVIDIA's PyTorch builds
# only): what this machine lacks, listed as not swept, not a megatron-core bug
MISSING_CODE = re.compile(r"ModuleNotFoundError|ImportError|No module named|CUDA extension|"
                          r"\b(not installed|is not found|[Pp]lease install)\b|"
                          r"module 'torch(\.\w+)*' has no attribute")
CANNOT_RUN_HERE = "this machine lacks code it needs"
VALIDATOR = re.compile(r"_?(ensure|validate|check|verify)(_|$)")  # ensure_divisibility, _validate_x


def _megatron_frame(failure: PoolFailure) -> str | None:
    """``file:line in function`` of the innermost megatron-core frame of the first traceback."""
    for text in (failure.tracebacks[rank] for rank in sorted(failure.tracebacks)):
        frames = re.findall(r'File "([^"]*/megatron/core/[^"]*)", line (\d+), in (\S+)', text)
        if frames:
            path, line, function = frames[-1]
            return f"{megatron_path(path)}:{line} in {function}"
    return None


# frames between megatron-core's code and the op that raised: torch's, and shardcheck's CPU
# stand-ins and checker modes that pass each op on
_PASSED_ON = ("/torch/", "/shardcheck/megatron/cpu/", "/shardcheck/typecheck/", "/shardcheck/patching.py")


def _raised_in_megatron(failure: PoolFailure) -> bool:
    """Whether the first traceback's last exception was raised in megatron-core's own code: its
    innermost frame outside torch and shardcheck's CPU layer is megatron-core's (an op that
    megatron-core called and that refused its tensors counts as megatron-core's)."""
    whole = failure.tracebacks[min(failure.tracebacks)] if failure.tracebacks else ""
    frames = _FRAME.findall(whole.rsplit("Traceback (most recent call last):", 1)[-1])
    own = [path for path, _ in frames if not any(part in path for part in _PASSED_ON)]
    return bool(own) and _MEGATRON in own[-1]


def _after_last_frame(text: str) -> list[str]:
    """The lines of a traceback after its last frame's header: the source line, the exception."""
    last = list(_FRAME.finditer(text))
    return (text[last[-1].end():] if last else text).splitlines()


def _exception_line(text: str) -> str:
    """The line a traceback ends with: ``Type: message``."""
    return next((ln for ln in _after_last_frame(text) if ln and not ln.startswith(" ")), "")


def _raised_type(text: str) -> str:
    """The class name (unqualified) of the exception a traceback ends with."""
    return _exception_line(text).split(":", 1)[0].rsplit(".", 1)[-1]


def option_fields(case: Case) -> tuple[str, ...]:
    """The config fields and arguments the case's options set (``GPTModel.parallel_output``: its
    ``parallel_output``)."""
    return tuple(name.rsplit(".", 1)[-1] for name, _ in case.options)


def _in_config_check(failure: PoolFailure, options: tuple[str, ...] = ()) -> bool:
    """Whether megatron-core refused its arguments: the error passed through a config's
    ``__post_init__`` (its own check, or a validator it calls), or megatron-core itself raised
    an AssertionError or ValueError in an argument check (:func:`_argument_check`) or naming one
    of the case's ``options`` (a check where the option is read: ``fused_single_qkv_rope requested
    but not ... supported for the config``)."""
    whole = failure.tracebacks[min(failure.tracebacks)] if failure.tracebacks else ""
    if re.search(r'File "[^"]*/megatron/core/[^"]*", line \d+, in __post_init__', whole):
        return True
    text = whole.rsplit("Traceback (most recent call last):", 1)[-1]  # the last exception's
    frames = _FRAME.findall(text)
    raised = _raised_type(text)
    return (failure.kind == "error" and bool(frames) and _MEGATRON in frames[-1][0] and raised in REFUSED_TYPES
            and (_argument_check(frames, raised) or _names_an_option(text, options) or _says_unsupported(text)))


# megatron-core declining a combination in so many words: "Attention bias is not supported for
# DotProductAttention", "Please use TEDotProductAttention instead"
UNSUPPORTED = re.compile(r"\bnot (yet )?supported\b|\bunsupported\b|[Pp]lease use \S+ instead")


def _says_unsupported(text: str) -> bool:
    """Whether the last exception's message says the combination is not supported."""
    return bool(UNSUPPORTED.search(text.rstrip().rsplit("\n", 1)[-1]))


def _names_an_option(text: str, options: tuple[str, ...]) -> bool:
    """Whether the last exception's message names one of the options (as a word, a field's name
    with an underscore: a long enough name not to be an English word)."""
    message = text.rstrip().rsplit("\n", 1)[-1]
    return any("_" in name and re.search(rf"\b{re.escape(name)}\b", message) for name in options)


def _argument_check(frames: list[tuple[str, str]], raised: str) -> bool:
    """Whether the innermost frame, megatron-core's, checks arguments: a constructor; a
    validator (``ensure_divisibility``, ``validate_*``) under a constructor; or, for a
    ValueError, the one megatron-core function the caller called, raising in its own body
    before calling into megatron-core (a schedule refusing its config)."""
    functions = [function for path, function in frames if _MEGATRON in path]
    if functions[-1] in CONSTRUCTORS:
        return True
    if VALIDATOR.match(functions[-1]) and any(f in CONSTRUCTORS for f in functions[:-1]):
        return True
    return raised == "ValueError" and len(functions) == 1


def first_line(failure: PoolFailure) -> str:
    """The line of a failure a person reads (300 characters at most): the exception the first
    rank that raised ended with, as that rank left the others waiting; else the hang or desync."""
    if failure.tracebacks:
        return raised_line(failure.tracebacks[min(failure.tracebacks)])[:300]
    lines = [ln.strip() for ln in str(failure).splitlines() if ln.strip() and not ln.startswith(" ")]
    errors = [ln for ln in lines if not ln.startswith(("rank ", "last collective", "Traceback"))]
    return (errors[-1] if errors else lines[0] if lines else failure.kind)[:300]


def raised_line(traceback_text: str) -> str:
    """A traceback's exception line; a bare ``assert`` (no message, or one that only prints
    values) is named by its statement: ``AssertionError: assert x not in d``."""
    line = _exception_line(traceback_text) or traceback_text.strip()
    if line.split(":", 1)[0].endswith("AssertionError") and not _prose(line.partition(":")[2]):
        statement = next((ln.strip() for ln in _after_last_frame(traceback_text)
                          if ln.strip().startswith("assert ")), None)
        if statement and not statement.endswith(("(", "\\")):  # the whole statement is on its line
            return f"AssertionError: {statement}"
    return line


def _prose(message: str) -> bool:
    """Whether an exception message reads as words (not empty, not a printed value)."""
    return bool(re.search(r"[A-Za-z]{3,}", message)) and not re.match(r"\s*[\w.]*[(\[{]", message)


def op_counts(per_rank: Iterable[dict | None]) -> dict | None:
    """The sum of op-call counts (``typed``, ``unknown``, ``unknown_at`` by location,
    ``unknown_from`` by the origin of the unknown); None when none was counted (the checker
    was off)."""
    counted = [c for c in per_rank if c]
    if not counted:
        return None
    return {"typed": sum(c["typed"] for c in counted), "unknown": sum(c["unknown"] for c in counted),
            "unknown_at": _summed(c["unknown_at"] for c in counted),
            "unknown_from": _summed(c.get("unknown_from", {}) for c in counted)}


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for key, n in c.items():
            total[key] = total.get(key, 0) + n
    return total
