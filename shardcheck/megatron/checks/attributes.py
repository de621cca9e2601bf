"""Set attributes of modules for the length of a block, and put the previous values back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def attributes_set(assignments: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    """Inside: ``setattr(owner, name, value)`` for each ``(owner, name, value)``; at exit each
    attribute gets back the value it had before, even when the block raised."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in assignments]
    for owner, name, value in assignments:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
