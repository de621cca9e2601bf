"""The fix of a replicated tensor's gradient left a partial sum at a split: all-reduce it.

A split's backward joins its pieces' gradients (``aten.cat``); where one of them is a partial
sum over an axis and another is whole, the checker reports "affine on partial" in that backward
node, and the audit locates it at the split's forward line (anomaly mode). The piece was used
as a replicated value downstream, but only this rank's share of its uses' gradient reached it,
and no collective summed the shares: what Megatron's ``copy_to_tensor_model_parallel_region``
is for (identity forward, all-reduce backward). The fix puts that all-reduce over the axis's
group on the partial pieces of the split at that line, for the class, wherever it is found
(MLA's rotary key ``k_pos_emb`` is one such piece).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from shardcheck.megatron.checks.paths import megatron_path
from shardcheck.typecheck.locations import user_code_frame

PREFIX = "reduced gradients of pieces "  # a fix's name: PREFIX + "AXIS:I,J:FILE:LINE"
SPLIT_NODES = frozenset({"SplitBackward0", "SplitWithSizesBackward0"})
_SPLITS = frozenset({torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk,
                     torch.Tensor.split_with_sizes})


def fix_for(violation: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """The fix (name, note) of a violation raised where a split's backward joins partial piece
    gradients with whole ones, located at the split (its forward line), else None."""
    if (violation is None or violation.get("backward") not in SPLIT_NODES or not violation.get("partial")
            or not violation.get("axis") or not violation["op"].startswith("aten.cat")):
        return None
    pieces, axis, site = violation["partial"], violation["axis"], violation["location"]
    name = f"{PREFIX}{axis}:{','.join(map(str, pieces))}:{site}"
    note = (f"all-reduce over {axis} the gradient of piece {' and '.join(map(str, pieces))} of the split at "
            f"{site} (copy_to_tensor_model_parallel_region on it after the split): each {axis} rank "
            f"holds only its share of it")
    return name, note


def parse(name: str) -> tuple[str, tuple[int, ...], str]:
    """A fix's (axis, piece indices, site) from its name (:func:`fix_for`)."""
    axis, pieces, site = name.removeprefix(PREFIX).split(":", 2)
    return axis, tuple(int(i) for i in pieces.split(",")), site


class _ReducedGradient(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _PiecesReduced(TorchFunctionMode):
    """Splits called at a fix's site return the fix's pieces through :class:`_ReducedGradient`."""

    def __init__(self, fixes: dict[str, tuple[Any, tuple[int, ...]]]) -> None:
        super().__init__()
        self.fixes = fixes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in _SPLITS:
            return out
        frame = user_code_frame()
        fix = self.fixes.get(megatron_path(f"{frame.f_code.co_filename}:{frame.f_lineno}")) if frame else None
        if fix is None:
            return out
        group, pieces = fix
        return type(out)(_ReducedGradient.apply(t, group) if i in pieces else t for i, t in enumerate(out))


@contextmanager
def reduced(groups: Mapping[str, Any], names: tuple[str, ...]) -> Iterator[None]:
    """Run the block with the named fixes (:data:`PREFIX`) in place; ``groups`` by axis name."""
    fixes = {site: (groups[axis], pieces) for axis, pieces, site in map(parse, names)}
    with _PiecesReduced(fixes) if fixes else nullcontext():
        yield
