"""Where a parameter's module is built: the line of its owner's constructor that assigns it,
which a gradient finding names (the parameter built without the metadata its gradient needs)."""

import inspect

import torch
from torch import nn

from shardcheck.megatron.checks.typecheck import construction_site


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(2))
        self.out_norm = nn.LayerNorm(4)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer: nn.Module = Mixer()


def _line_of(cls: type, text: str) -> str:
    lines, first = inspect.getsourcelines(cls)
    return f"{__file__}:{first + next(i for i, line in enumerate(lines) if text in line)}"


def test_a_submodules_parameter_is_located_where_its_owner_assigns_the_submodule():
    assert construction_site(Mixer(), "out_norm.weight") == _line_of(Mixer, "self.out_norm =")
    assert construction_site(Block(), "mixer.out_norm.bias") == _line_of(Mixer, "self.out_norm =")


def test_a_parameter_a_class_assigns_itself_is_located_there():
    assert construction_site(Mixer(), "A_log") == _line_of(Mixer, "self.A_log =")
    assert construction_site(Block(), "mixer.A_log") == _line_of(Mixer, "self.A_log =")


def test_a_module_no_constructor_assigns_has_no_site():
    assert construction_site(nn.Sequential(nn.Linear(2, 2)), "0.weight") is None
