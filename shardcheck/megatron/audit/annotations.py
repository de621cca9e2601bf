"""Read the annotations of Megatron's configs and constructors, whatever form they take.

Megatron annotates with plain types, ``Optional``/``Union`` and ``X | Y``, ``Literal`` (whose
values may themselves be lists or tuples), ``Callable[[...], ...]`` (whose arguments include a
list), ``Annotated[...]`` and, in modules with ``from __future__ import annotations``, strings
that name types imported only for type checkers. :func:`type_hints` resolves what it can and
keeps what it cannot as a :class:`typing.ForwardRef`; :func:`members` flattens unions and strips
``Annotated``, so the callers ask one question per member.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Any

_UNIONS = (typing.Union, types.UnionType)


def type_hints(obj: Any) -> dict[str, Any]:
    """The resolved annotations of a class (its whole MRO) or a function; an annotation that
    cannot be resolved (a name only imported under ``TYPE_CHECKING``) stays a ForwardRef."""
    try:
        return typing.get_type_hints(obj)
    except Exception:  # noqa: BLE001 - one unresolvable name: resolve the others one by one
        pass
    hints: dict[str, Any] = {}
    owners = reversed(obj.__mro__) if isinstance(obj, type) else [obj]
    for owner in owners:
        module = sys.modules.get(getattr(owner, "__module__", ""), None)
        namespace = dict(vars(module)) if module else {}
        if isinstance(owner, type):
            namespace.update(vars(owner))
        for name, annotation in getattr(owner, "__annotations__", {}).items():
            hints[name] = _resolved(annotation, namespace)
    return hints


def _resolved(annotation: Any, namespace: dict[str, Any]) -> Any:
    holder = types.SimpleNamespace(__annotations__={"x": annotation})
    try:
        return typing.get_type_hints(holder, globalns=namespace)["x"]
    except Exception:  # noqa: BLE001 - unresolvable: kept as the name it gives
        text = annotation if isinstance(annotation, str) else repr(annotation)
        return typing.ForwardRef(text)


def members(annotation: Any) -> list[Any]:
    """The alternatives of an annotation: unions flattened, ``Annotated`` stripped."""
    if typing.get_origin(annotation) is typing.Annotated:
        return members(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in _UNIONS:
        return [m for arg in typing.get_args(annotation) for m in members(arg)]
    return [annotation]


def literal_values(annotation: Any) -> list[Any]:
    """The values of a ``Literal`` (nested ``Literal`` flattened); values may be lists."""
    found: list[Any] = []
    for arg in typing.get_args(annotation):
        found += literal_values(arg) if typing.get_origin(arg) is typing.Literal else [arg]
    return found


def unique(values: list[Any]) -> list[Any]:
    """The values in order, each once (by equality: lists and dicts are values too)."""
    kept: list[Any] = []
    for value in values:
        if not any(value == k and type(value) is type(k) for k in kept):
            kept.append(value)
    return kept
