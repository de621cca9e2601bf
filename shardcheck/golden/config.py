"""Read the parts of a Megatron functional-test ``model_config.yaml`` that golden triage needs.

The venv has no YAML library, and these files use a small subset of YAML: top-level keys,
one level of ``key: value`` mappings (MODEL_ARGS, ENV_VARS), ``- item`` lists (METRICS),
``&anchor`` / ``<<: *anchor`` merges and ``|`` block scalars. This reader handles exactly
that subset and ignores block-scalar bodies (shell scripts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from shardcheck.golden.io import GoldenInputError

DEFAULT_METRICS = ("lm loss", "num-zeros")
_TOP = re.compile(r"^([A-Za-z_][\w-]*):\s*(.*)$")
_ENTRY = re.compile(r"^\s+(\S[^:]*?):\s*(.*)$")
_ITEM = re.compile(r"^\s+-\s+(.*)$")


@dataclass
class ModelConfig:
    """The sections of a model_config.yaml: scalars, mappings and lists by top-level key."""

    source: str
    scalars: dict[str, str] = field(default_factory=dict)
    mappings: dict[str, dict[str, str]] = field(default_factory=dict)
    lists: dict[str, list[str]] = field(default_factory=dict)

    @property
    def model_args(self) -> dict[str, str]:
        return self.mappings.get("MODEL_ARGS", {})

    @property
    def env_vars(self) -> dict[str, str]:
        return self.mappings.get("ENV_VARS", {})

    @property
    def test_type(self) -> str:
        return self.scalars.get("TEST_TYPE", "regular")

    def metrics(self) -> tuple[str, ...]:
        """The metrics Megatron's CI checks: METRICS, or lm loss and num-zeros by default."""
        return tuple(self.lists["METRICS"]) if "METRICS" in self.lists else DEFAULT_METRICS

    def allows_nondeterministic(self) -> bool:
        """True when the CI would pass --allow-nondeterministic-algo (approximate checks only)."""
        env = self.env_vars
        return (
            env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "1"
            or env.get("NON_DETERMINSTIC_RESULTS") == "1"
        )

    def arg_int(self, name: str, default: int | None = None) -> int | None:
        """An integer MODEL_ARGS value such as ``--hidden-size``, or ``default``."""
        raw = self.model_args.get(name)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise GoldenInputError(f"{self.source}: {name} is {raw!r}, not an integer") from None

    def arg_flag(self, name: str) -> bool:
        """A boolean MODEL_ARGS flag such as ``--swiglu``."""
        return self.model_args.get(name, "false").lower() == "true"


def load_model_config(path: str | Path) -> ModelConfig:
    """Parse a model_config.yaml; raise GoldenInputError with one line if it can't be used."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise GoldenInputError(f"{path}: cannot read ({reason})") from None
    return parse_model_config(text, str(path))


def parse_model_config(text: str, source: str) -> ModelConfig:
    """Parse model_config.yaml text (see the module docstring for the subset)."""
    config = ModelConfig(source)
    anchors: dict[str, dict[str, str]] = {}
    key, in_block_scalar, last = None, False, None
    for number, line in enumerate(text.splitlines(), start=1):
        body = _strip_comment(line)
        if not body.strip():
            continue
        top = _TOP.match(body)
        if top:
            key, rest = top.groups()
            in_block_scalar = rest.startswith(("|", ">"))
            _start_section(config, anchors, key, rest)
        elif key is None:
            raise GoldenInputError(f"{source}:{number}: indented line before any top-level key")
        elif not in_block_scalar:
            last = _add_child(config, anchors, key, last, body, f"{source}:{number}")
    if not config.scalars and not config.mappings and not config.lists:
        raise GoldenInputError(f"{source}: no top-level keys, not a model_config.yaml")
    return config


def _start_section(config: ModelConfig, anchors: dict, key: str, rest: str) -> None:
    if rest.startswith("&"):
        anchors[rest[1:].strip()] = config.mappings.setdefault(key, {})
    elif rest.startswith("[") and rest.endswith("]"):
        items = [_unquote(i) for i in rest[1:-1].split(",") if i.strip()]
        config.lists[key] = items
    elif rest and not rest.startswith(("|", ">")):
        config.scalars[key] = _unquote(rest)


def _add_child(
    config: ModelConfig, anchors: dict, key: str, last: str | None, body: str, where: str
) -> str | None:
    """Record one indented line under ``key``; return the entry name a continuation joins."""
    item = _ITEM.match(body)
    if item:
        config.lists.setdefault(key, []).append(_unquote(item.group(1)))
        return None
    mapping = config.mappings.setdefault(key, {})
    entry = _ENTRY.match(body)
    if not entry:
        if last is None or mapping.get(last):
            raise GoldenInputError(f"{where}: cannot read this line as 'key: value'")
        mapping[last] = _unquote(body)
        return None
    name, value = _unquote(entry.group(1)), entry.group(2)
    if name == "<<" and value.startswith("*"):
        mapping.update(anchors.get(value[1:].strip(), {}))
    elif body.startswith("  ") and not body.startswith("   "):
        mapping[name] = _unquote(value)
        return name
    return None


def _strip_comment(line: str) -> str:
    if line.lstrip().startswith("#"):
        return ""
    return re.sub(r"\s+#.*$", "", line) if not _has_quote_hash(line) else line


def _has_quote_hash(line: str) -> bool:
    return bool(re.search(r"[\"'][^\"']*#[^\"']*[\"']", line))


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value
