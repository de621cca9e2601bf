"""A shape crash's root: where megatron-core made the ill-shaped operand (audit/operands.py)."""

import importlib.util
import os
import traceback
from pathlib import Path

import pytest
import torch

from shardcheck.megatron.audit.operands import (
    MADE_AT,
    made_at,
    operand_makers,
    operands_noted,
    wrong_operand,
)

# Megatron-LM 16a8cdb64b's class: one function builds a tensor of the wrong shape (the output
# gate left unsliced), another fails to view it (``_apply_output_gate``)
ATTENTION = '''
import torch

def get_query_key_value_tensors(mixed):
    gate = mixed.reshape(4, 2, -1)
    return gate


def _apply_output_gate(x, gate):
    gate = gate.contiguous().float()
    gate = gate.view(*x.shape)
    return x * torch.sigmoid(gate)
'''


def _load(root: Path, relative: str, source: str):
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _raised(root: Path, module) -> str:
    gate = module.get_query_key_value_tensors(torch.ones(4, 2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="is invalid for input of size") as raised:
        module._apply_output_gate(torch.ones(4, 2, 2, 2), gate)
    return "".join(traceback.format_exception(raised.value))


def test_a_shape_error_names_the_function_that_made_the_operand(tmp_path):
    module = _load(tmp_path, "megatron/core/transformer/attention.py", ATTENTION)
    with operand_makers(str(tmp_path) + os.sep):
        text = _raised(tmp_path, module)
    # followed back through the raising function's own ops (the cast) to the reshape that made it
    assert made_at(text) == ("megatron/core/transformer/attention.py:5", "get_query_key_value_tensors"), text


def test_an_operand_a_generic_layer_made_names_no_root(tmp_path):
    module = _load(tmp_path, "megatron/core/tensor_parallel/utils.py", ATTENTION)
    with operand_makers(str(tmp_path) + os.sep):
        text = _raised(tmp_path, module)
    assert MADE_AT not in text and made_at(text) is None


def test_without_the_makers_noted_a_shape_error_has_no_note(tmp_path):
    module = _load(tmp_path, "megatron/core/transformer/attention.py", ATTENTION)
    assert made_at(_raised(tmp_path, module)) is None


def test_an_operand_whose_data_was_replaced_since_names_no_root(tmp_path):
    """A checkpoint distributing its saved activations sets ``tensor.data`` to a 1-D chunk: the
    line that made the tensor did not make that shape."""
    module = _load(tmp_path, "megatron/core/transformer/attention.py", ATTENTION)
    with operand_makers(str(tmp_path) + os.sep):
        gate = module.get_query_key_value_tensors(torch.ones(4, 2, 8, dtype=torch.float64))
        gate.data = gate.data.reshape(-1)
        with pytest.raises(RuntimeError) as raised:
            module._apply_output_gate(torch.ones(4, 2, 2, 2), gate)
    assert made_at("".join(traceback.format_exception(raised.value))) is None


# Megatron's ColumnParallelLinearGathered under sequence parallelism: it pads the sequence dim
# where it means the hidden one, and the residual add after the layer fails with two operands
WIDEN = '''
import torch.nn.functional as F

def gathered(x):
    return F.pad(x, [0, 0, 0, 0, 2, 2])
'''
SCATTER = '''
def scatter(x):
    return x.narrow(0, 0, x.shape[0] // 2).clone()
'''
ADD = '''
def bias_dropout_add(out, residual):
    return residual + out
'''


def _unbroadcast(tmp_path) -> str:
    widen = _load(tmp_path, "megatron/core/transformer/heterogeneous/linear_replacements.py", WIDEN)
    scatter = _load(tmp_path, "megatron/core/tensor_parallel/mappings.py", SCATTER)
    add = _load(tmp_path, "megatron/core/fusions/fused_bias_dropout.py", ADD)
    with operand_makers(str(tmp_path) + os.sep):
        residual = torch.ones(4, 2, 8) * 2
        out = scatter.scatter(widen.gathered(torch.ones(4, 2, 4)))
        with pytest.raises(RuntimeError, match="must match the size of tensor b") as raised:
            add.bias_dropout_add(out, residual)
    return "".join(traceback.format_exception(raised.value))


def test_two_operands_that_do_not_broadcast_are_noted_with_their_makers_through_the_generic_layers(tmp_path):
    noted = operands_noted(_unbroadcast(tmp_path))
    assert made_at(_unbroadcast(tmp_path)) is None  # two operands: no one maker named
    assert noted["site"] == "megatron/core/fusions/fused_bias_dropout.py:3" and noted["call"] == 1
    assert noted["dim"] == 2 and noted["shapes"] == [[4, 2, 8], [4, 2, 4]]
    # the residual was made outside megatron-core; the layer's output back through the generic
    # scatter (mappings.py) to the pad that made its shape
    assert noted["makers"] == [None, ["megatron/core/transformer/heterogeneous/linear_replacements.py:5", "gathered"]]


def test_the_one_rank_run_tells_which_operand_is_wrong(tmp_path):
    noted = operands_noted(_unbroadcast(tmp_path))
    pad = ("megatron/core/transformer/heterogeneous/linear_replacements.py:5", "gathered")
    assert wrong_operand(noted, [[4, 2, 8], [4, 2, 8]]) == pad  # the output's dim 2 changed, the residual's not
    assert wrong_operand(noted, [[4, 2, 16], [4, 2, 4]]) is None  # the residual's changed: it has no maker
    assert wrong_operand(noted, [[4, 2, 16], [4, 2, 8]]) is None  # both changed: no telling
    assert wrong_operand(noted, [[4, 8], [4, 2, 8]]) is None  # another call's operands
    assert wrong_operand(noted, None) is None
