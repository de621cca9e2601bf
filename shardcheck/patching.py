"""Set attributes for a while and put back what they held: shardcheck's one set-and-restore.

:func:`patched` and :func:`patched_attrs` set attributes for the length of a block; a
:class:`Patches` record does it for longer (between an ``apply`` and a ``remove``). Either way
every attribute gets back the value it had, or is deleted where it had none, the last set first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

_MISSING = object()


class Patches:
    """Attributes set on objects, each with the value it replaced, until :meth:`restore`."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, remembering what ``owner.name`` held (if anything);
        of a class, its own entry as it is stored (a ``staticmethod`` stays one; an inherited
        attribute is inherited again after :meth:`restore`)."""
        held = vars(owner).get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        setattr(owner, name, value)
        self._saved.append((owner, name, held))

    def restore(self) -> None:
        """Put every attribute set back, the last set first; one that was missing is deleted."""
        while self._saved:
            owner, name, value = self._saved.pop()
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


@contextlib.contextmanager
def patched_attrs(assignments: Iterable[tuple[Any, str, Any]]) -> Iterator[None]:
    """Inside: ``setattr(owner, name, value)`` for each ``(owner, name, value)``, in order; at
    exit every attribute gets back what it held, even when the block (or a later assignment)
    raised."""
    patches = Patches()
    try:
        for owner, name, value in assignments:
            patches.set(owner, name, value)
        yield
    finally:
        patches.restore()


def patched(owner: Any, name: str, value: Any) -> contextlib.AbstractContextManager[None]:
    """Inside: ``owner.name`` is ``value``; at exit it holds what it held before."""
    return patched_attrs([(owner, name, value)])
