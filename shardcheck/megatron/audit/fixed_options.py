"""``shardcheck audit --set NAME=VALUE``: each value checked against the field it sets.

An option names a field of the component's setup dataclass, for a component that takes a
``config`` a field of ``TransformerConfig``, or an argument of its model class's constructor
(``GPTModel.rope_scaling``) or forward (``GPTModel.forward.runtime_gather_output``). Its value must fit the field's annotation:
``true``/``false`` for a boolean, a number for a number, one of the choices of a ``Literal``
or an ``Enum`` (given by member name, ``Class.member`` also taken), and for a setup string the
choices a Megatron constructor declares for it. Annotations that say nothing checkable
(callables, dtypes, containers, unresolved names) accept any value.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from typing import Any

from shardcheck.megatron.audit.annotations import literal_values, members, type_hints
from shardcheck.megatron.audit.sweep import (
    ARGUMENT_FIELDS,
    config_class,
    megatron_literals,
    model_argument,
    model_class,
    parse_value,
)

_PLAIN = {type(None): "none", bool: "true or false", int: "an integer", float: "a number",
          str: "a string"}


class OptionError(ValueError):
    """A ``--set`` option the component has no field for, or a value its field cannot take."""


def checked_value(component: str, name: str, value: Any) -> Any:
    """``value`` as the field ``name`` of ``component`` takes it (an Enum member from its
    name); :class:`OptionError` saying what the field takes when it cannot be used."""
    annotation = field_annotation(component, name)
    kinds = members(annotation)
    if any(_fits(kind, value) for kind in kinds):
        return value
    member = _enum_member(kinds, value)
    if member is not None:
        return member
    if not all(_checkable(kind) for kind in kinds):
        return value
    raise OptionError(f"{component}'s {name} takes {_describe(kinds)}, not {value!r}")


def value_from_text(component: str, name: str, text: str) -> Any:
    """The value ``--set name=text`` gives: an Enum member or a string choice the field names
    by ``text`` (gpt's position_embedding 'none', InferenceCudaGraphScope.none), else ``text``
    read as true/false/none or a number (:func:`parse_value`), checked by :func:`checked_value`."""
    raw = text.strip()
    kinds = members(field_annotation(component, name))
    member = _enum_member(kinds, raw)
    if member is not None:
        return member
    if any(raw in literal_values(kind) for kind in kinds if typing.get_origin(kind) is typing.Literal):
        return raw
    return checked_value(component, name, parse_value(text))


def field_annotation(component: str, name: str) -> Any:
    """The annotation of the setup field or TransformerConfig field that ``name`` sets."""
    from shardcheck.megatron.scenarios import COMPONENTS

    setup_cls = COMPONENTS[component].setup
    own = {f.name for f in dataclasses.fields(setup_cls)} - {"config"}
    if (argument := model_argument(name)) is not None:
        return _argument_annotation(component, name, *argument)
    if name in own:
        annotation, literals = type_hints(setup_cls)[name], megatron_literals()
        choices = literals.get(name) or literals.get(f"{name}_type")
        return typing.Literal[choices] if annotation is str and choices else annotation
    if "config" not in {f.name for f in dataclasses.fields(setup_cls)}:
        raise OptionError(f"{component} has no option {name!r}; its options: {sorted(own)}")
    cls = config_class(component)
    if name not in {f.name for f in dataclasses.fields(cls)}:
        raise OptionError(f"{component} has no option {name!r}: not a field of its setup "
                          f"({', '.join(sorted(own))}) nor of {cls.__name__}")
    return type_hints(cls).get(name, Any)


def _argument_annotation(component: str, name: str, setup_field: str, argument: str) -> Any:
    """The annotation of the model-class argument that ``name`` sets."""
    from shardcheck.megatron.scenarios import COMPONENTS

    cls = model_class(component)
    method = next(m for m, f in ARGUMENT_FIELDS.items() if f == setup_field)
    if (cls is None or not name.startswith(f"{cls.__name__}.")
            or setup_field not in {f.name for f in dataclasses.fields(COMPONENTS[component].setup)}):
        raise OptionError(f"{component} takes no model argument {name!r}")
    function = getattr(cls, method)
    if argument not in inspect.signature(function).parameters:
        raise OptionError(f"{component} has no option {name!r}: {cls.__name__}.{method} takes no "
                          f"argument {argument!r}")
    return type_hints(function).get(argument, Any)


def _fits(kind: Any, value: Any) -> bool:
    if kind is type(None):
        return value is None
    if kind in (bool, str):
        return isinstance(value, kind)
    if kind in (int, float):
        return isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    if typing.get_origin(kind) is typing.Literal:
        return any(choice == value and type(choice) is type(value) for choice in literal_values(kind))
    return _is_enum(kind) and isinstance(value, kind)


def _enum_member(kinds: list[Any], value: Any) -> enum.Enum | None:
    for kind in filter(_is_enum, kinds):
        member = kind.__members__.get(str(value).rpartition(".")[2])
        if member is not None and str(value) in (member.name, f"{kind.__name__}.{member.name}"):
            return member
    return None


def _is_enum(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, enum.Enum)


def _checkable(kind: Any) -> bool:
    return kind in _PLAIN or typing.get_origin(kind) is typing.Literal or _is_enum(kind)


def _describe(kinds: list[Any]) -> str:
    parts = []
    for kind in kinds:
        if typing.get_origin(kind) is typing.Literal:
            parts.append("one of " + ", ".join(map(repr, literal_values(kind))))
        elif _is_enum(kind):
            parts.append("one of " + ", ".join(kind.__members__))
        else:
            parts.append(_PLAIN[kind])
    return " or ".join(parts)
