"""The fix of a gradient left partial at a split: the all-reduce of its pieces' gradients."""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch.overrides import TorchFunctionMode

from shardcheck.megatron.repro.parts.script import PIECE_FIX, run

FIXED = "--fixed" in sys.argv[1:]  # run everything with the fix: the pieces' gradients all-reduced
SPLITS = (torch.split, torch.Tensor.split, torch.Tensor.split_with_sizes, torch.chunk, torch.Tensor.chunk)


class ReducedGradient(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the fix's axis."""

    forward = staticmethod(lambda ctx, x: x.view_as(x))

    @staticmethod
    def backward(ctx, grad):
        group = {"tp": ps.get_tensor_model_parallel_group, "cp": ps.get_context_parallel_group,
                 "dp": ps.get_data_parallel_group}[PIECE_FIX[0]]()
        dist.all_reduce(grad := grad.contiguous(), group=group)
        return grad


class PiecesReduced(TorchFunctionMode):
    """A split called at the finding's line returns its partial pieces through ReducedGradient."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out, frame = func(*args, **(kwargs or {})), sys._getframe(1)
        while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
            frame = frame.f_back
        if func not in SPLITS or frame is None or not f"{frame.f_code.co_filename}:{frame.f_lineno}".endswith(PIECE_FIX[2]):
            return out
        return type(out)(ReducedGradient.apply(t) if i in PIECE_FIX[1] else t for i, t in enumerate(out))


def with_fix(sizes, on):
    """``sizes``; when ``on``, the component runs with the pieces' gradients all-reduced."""
    return {**sizes, "pieces_reduced": on}


component_run = run


def run(sizes, pg):  # noqa: F811 - the component's run, under the fix when its sizes ask for it
    with PiecesReduced() if sizes.get("pieces_reduced") else contextlib.nullcontext():
        return component_run(sizes, pg)
