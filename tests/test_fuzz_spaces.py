"""Search spaces shrink to the fewest ranks, the smallest sizes and the default options."""

import dataclasses
import enum
import typing

from hypothesis import find
from hypothesis import strategies as st

from shardcheck.fuzz.spaces import (
    default_fields,
    layouts,
    non_default,
    option,
    per_rank,
    signature_space,
    space,
)
from shardcheck.parity.layout import Layout


def test_layouts_shrink_to_fewest_ranks_and_options_to_default():
    assert find(layouts(["tp2-dp2", "dp2", "tp4"]), lambda _: True) == "dp2"
    assert find(option(0.0, 0.1, 0.2), lambda _: True) == 0.0
    assert find(option(0.0, 0.1, 0.2), lambda x: x > 0) == 0.1


def test_per_rank_fields_have_one_value_per_rank():
    example = find(space(["dp3"], tokens=per_rank("dp", st.integers(1, 4))), lambda _: True)
    assert example == {"layout": "dp3", "tokens": [1, 1, 1]}


def test_signature_space_varies_keyword_defaults():
    def scenario(ctx, sizes=3, smoothing=0.0, masked=False, name="x"):
        return {}

    example = find(signature_space(scenario, ["tp2"]), lambda e: e["masked"] and e["sizes"] != 3)
    assert example == {"layout": "tp2", "sizes": 1, "smoothing": 0.0, "masked": True}
    assert Layout.parse(example["layout"]).world_size == 2


class Norm(enum.Enum):
    LAYER = "LayerNorm"
    RMS = "RMSNorm"


@dataclasses.dataclass
class Setup:
    padding: bool = False
    norm: Norm = Norm.LAYER
    activation: typing.Literal["gelu", "swiglu", "relu"] = "gelu"
    layers: int = 2
    name: str = "tiny"
    config: dict = dataclasses.field(default_factory=dict)


def test_default_fields_of_a_dataclass_shrink_to_the_defaults():
    fields = default_fields(Setup)
    assert sorted(fields) == ["activation", "layers", "norm", "padding"]
    drawn = find(st.fixed_dictionaries(fields), lambda d: d["norm"] is Norm.RMS and d["activation"] != "gelu")
    assert drawn == {"padding": False, "norm": Norm.RMS, "activation": "swiglu", "layers": 2}


def test_non_default_keeps_only_the_changed_options():
    overrides = non_default(default_fields(Setup, only=["padding", "layers"]), Setup)
    assert find(overrides, lambda _: True) == {}
    assert find(overrides, lambda d: "layers" in d) == {"layers": 1}
