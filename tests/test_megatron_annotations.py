"""Reading annotations in every form Megatron writes them: pure functions, no megatron."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal, Optional

from shardcheck.megatron.audit.annotations import literal_values, members, type_hints, unique
from shardcheck.megatron.audit.fields import _finite_values

if TYPE_CHECKING:
    from collections import OrderedDict  # resolvable only by a type checker


@dataclass
class _Config:
    flag: bool = False
    mode: Optional[Literal["a", "b"]] = None  # noqa: UP045 - Megatron writes Optional
    shapes: Literal[(1, 2), [3]] = (1, 2)
    hidden: Annotated[int, "size"] = 4
    later: OrderedDict | None = None


def test_type_hints_resolve_what_they_can_and_keep_the_rest_as_a_forward_reference():
    hints = type_hints(_Config)
    assert hints["flag"] is bool
    assert members(hints["mode"]) == [Literal["a", "b"], type(None)]
    assert members(hints["hidden"]) == [int]
    assert isinstance(hints["later"], typing.ForwardRef)


def test_members_flatten_unions_and_strip_annotated():
    assert members(Annotated[int | Optional[str], "x"]) == [int, str, type(None)]  # noqa: UP045 - Megatron writes Optional


def test_literal_values_keep_lists_and_tuples_and_flatten_nested_literals():
    assert literal_values(Literal[(1, 2), [3], Literal["z"]]) == [(1, 2), [3], "z"]
    assert unique([[3], [3], (3,), 1, True]) == [[3], (3,), 1, True]


def test_finite_values_of_each_form():
    assert _finite_values(Optional[bool]) == (False, True, None)  # noqa: UP045 - Megatron writes Optional
    assert _finite_values(Annotated[Literal["a", "b"], "doc"]) == ("a", "b")
    assert _finite_values(Literal[[1], [2]]) == ([1], [2])
    assert _finite_values(typing.Callable[[int], int]) is None
    assert _finite_values(bool | int) is None
    assert _finite_values(typing.ForwardRef("X")) is None
