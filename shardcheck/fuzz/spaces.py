"""Search spaces for the fuzzer: layouts, configuration fields and inputs, each shrinking well.

An example is a dict ``{"layout": "tp2", **fields}``. Hypothesis shrinks towards the simplest
example; these helpers make "simplest" mean, in order: fewest ranks (:func:`layouts` is one
choice, smallest world first), smallest sizes (integers shrink down), and fewest non-default
options (:func:`option` is one choice and shrinks to its default).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from shardcheck.parity.layout import Layout

DEFAULT_LAYOUTS = ("tp2", "dp2", "cp2", "tp2-sp", "tp2-dp2", "tp2-cp2")

FieldSpace = st.SearchStrategy | Callable[[Layout, dict[str, Any]], st.SearchStrategy]


def option(default: Any, *alternatives: Any) -> st.SearchStrategy:
    """A configuration field that shrinks to ``default``, then to the alternatives in order.

    It is one choice for hypothesis, so a non-default option never makes an example look
    simpler than one with fewer ranks.
    """
    return st.sampled_from([default, *[a for a in alternatives if a != default]])


def layouts(names: Iterable[str | Layout]) -> st.SearchStrategy[str]:
    """Layouts, shrinking towards the fewest ranks (then the order given)."""
    parsed = [Layout.coerce(n) for n in names]
    ordered = sorted(parsed, key=lambda layout: layout.world_size)
    return st.sampled_from([str(layout) for layout in ordered])


def per_rank(axis: str, elements: FieldSpace) -> Callable[[Layout, dict[str, Any]], st.SearchStrategy]:
    """A field holding one value per rank of ``axis`` (e.g. token counts, padding per rank)."""
    def draw_list(layout: Layout, drawn: dict[str, Any]) -> st.SearchStrategy:
        size = layout.size(axis)
        return st.lists(_field(elements, layout, drawn), min_size=size, max_size=size)
    return draw_list


def space(layout_names: Sequence[str | Layout], **fields: FieldSpace) -> st.SearchStrategy[dict[str, Any]]:
    """Examples ``{"layout": ..., **fields}``, drawn in the order given.

    A field is a strategy, or a function ``(layout, drawn_so_far) -> strategy`` for fields that
    depend on the layout or on earlier fields (see :func:`per_rank`).
    """
    layout_strategy = layouts(layout_names)

    @st.composite
    def examples(draw: Callable[[st.SearchStrategy], Any]) -> dict[str, Any]:
        drawn: dict[str, Any] = {"layout": draw(layout_strategy)}
        layout = Layout.parse(drawn["layout"])
        for name, spec in fields.items():
            drawn[name] = draw(_field(spec, layout, drawn))
        return drawn

    return examples()


def _field(spec: FieldSpace, layout: Layout, drawn: dict[str, Any]) -> st.SearchStrategy:
    return spec if isinstance(spec, st.SearchStrategy) else spec(layout, drawn)


def signature_space(scenario: Callable[..., Any],
                    layout_names: Sequence[str] = DEFAULT_LAYOUTS) -> st.SearchStrategy[dict[str, Any]]:
    """A search space from a scenario's keyword defaults (see :func:`default_fields`)."""
    return space(layout_names, **default_fields(scenario))


def default_fields(source: Callable[..., Any] | type, only: Iterable[str] | None = None) -> dict[str, st.SearchStrategy]:
    """One field per default of a function's keywords or a dataclass's fields, shrinking to it.

    Bools flip; enums and ``Literal[...]`` fields take their other values; ints take 1..2x
    (at least 1..4); floats take 0.0, 0.1 and 0.5. Other defaults are left alone. ``only``
    keeps just the named fields (e.g. the CPU-compatible ones of a large config class).
    """
    wanted = set(only) if only is not None else None
    fields: dict[str, st.SearchStrategy] = {}
    for name, default, hint in _defaults(source):
        if wanted is not None and name not in wanted:
            continue
        choices = _choices(default, hint)
        if choices:
            fields[name] = option(default, *choices)
    return fields


def option_names(config: Mapping[str, Any], source: Callable[..., Any] | type | None = None) -> list[str]:
    """The names of a configuration's options, the part of a trigger that names a bug's cause.

    Sizes (ints, lists, tuples) are not options. With ``source``, only options set away from its
    keyword defaults count.
    """
    defaults = {name: default for name, default, _ in _defaults(source)} if source is not None else {}
    return sorted(name for name, value in config.items()
                  if not _is_size(value) and (name not in defaults or value != defaults[name]))


def _is_size(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (isinstance(value, int) and not isinstance(value, (bool, enum.Enum)))


def non_default(fields: Mapping[str, st.SearchStrategy], source: Callable[..., Any] | type) -> st.SearchStrategy[dict]:
    """A dict of only the fields drawn different from their defaults (e.g. config overrides)."""
    defaults = {name: default for name, default, _ in _defaults(source)}
    return st.fixed_dictionaries(dict(fields)).map(
        lambda drawn: {k: v for k, v in drawn.items() if v != defaults.get(k, object())})


def _defaults(source: Callable[..., Any] | type) -> list[tuple[str, Any, Any]]:
    """(name, default, type hint) of every defaulted keyword or dataclass field."""
    try:
        hints = typing.get_type_hints(source)
    except Exception:  # noqa: BLE001 - unresolvable annotations only cost the Literal choices
        hints = {}
    if dataclasses.is_dataclass(source):
        return [(f.name, f.default, hints.get(f.name)) for f in dataclasses.fields(source)
                if f.default is not dataclasses.MISSING]
    return [(name, p.default, hints.get(name)) for name, p in inspect.signature(source).parameters.items()
            if p.default is not inspect.Parameter.empty]


def _choices(default: Any, hint: Any) -> list[Any]:
    if typing.get_origin(hint) is typing.Literal:
        return list(typing.get_args(hint))
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, enum.Enum):
        return list(type(default))
    if isinstance(default, int):
        return list(range(1, max(2 * default, 4) + 1))
    if isinstance(default, float):
        return [0.0, 0.1, 0.5]
    return []
