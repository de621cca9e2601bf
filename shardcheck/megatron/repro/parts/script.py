"""What a repro script defines around its parts, declared for the parts' modules.

A script sets these itself (:func:`shardcheck.megatron.repro.templates.script_body` writes the
constants, :mod:`shardcheck.fuzz.repro` the checker line, the component's part ``run``, a fix
``FIXED`` and ``with_fix``, the Mamba stand-ins ``mamba_module``); a part imports them from here
so that its module is whole Python, and the import is left out of the script.
"""

from __future__ import annotations

from typing import Any

SETUP: dict[str, Any] = {}  # the component's setup fields
OVERRIDES: dict[str, Any] = {}  # TransformerConfig options
SECTIONS: dict[str, list[int]] = {}  # of fused weights, cut over tp
SIZES: dict[str, Any] = {}  # the finding's layout
ONE_RANK: dict[str, Any] = {}  # the reference's layout
CHECKER: str | None = None  # the checker's line the audit recorded
RAISED: tuple[str, str] = ("", "")  # a one-rank crash's exception type and megatron-core file
FIXED = False  # --fixed: run everything with the fix
PIECE_FIX: tuple[str, tuple[int, ...], str] = ("", (), "")  # a split's partial pieces: axis, indices, file:line
mamba_module: Any = None  # megatron's mamba_mixer, imported once its Triton helpers are stubbed


def run(sizes: dict[str, Any], pg: Any) -> Any:
    """The component's global values on the process groups ``pg`` of layout ``sizes``."""
    raise NotImplementedError("defined by the component's part")


def with_fix(sizes: dict[str, Any], on: bool) -> dict[str, Any]:
    """``sizes``, with the finding's fix applied when ``on``."""
    raise NotImplementedError("defined by the finding's fix")
