"""Guard against wrong AVG reductions on Gloo (pytorch issue #162338).

FSDP on Gloo once got summed instead of averaged gradients from a reduce-scatter with
``ReduceOp.AVG``. :func:`avg_problems` runs each AVG reduction on a group and compares it with
SUM then divide; the warm pool runs it at start and warns when anything differs.
:func:`all_reduce_mean` is the safe form: SUM, then divide by the group size.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def all_reduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Average ``tensor`` in place over ``group`` as SUM then divide, never ``ReduceOp.AVG``."""
    dist.all_reduce(tensor, group=group)
    return tensor.div_(dist.get_world_size(group))


def _per_rank(numel: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.float64) * 0.25 + 3 * rank + 1).to(dtype)


def _expected(numel: int, dtype: torch.dtype, ranks: list[int]) -> torch.Tensor:
    return torch.stack([_per_rank(numel, dtype, r).double() for r in ranks]).mean(0)


def avg_problems(group: dist.ProcessGroup | None = None, numel: int = 5) -> list[str]:
    """Describe every AVG reduction on ``group`` that differs from SUM then divide (empty: none)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me, size, problems = dist.get_rank(), len(ranks), []
    for dtype in (torch.float32, torch.float64):
        value, expected = _per_rank(numel, dtype, me), _expected(numel, dtype, ranks)
        results = {}
        out = value.clone()
        dist.all_reduce(out, op=dist.ReduceOp.AVG, group=group)
        results["all_reduce"] = out
        shard = torch.empty(numel, dtype=dtype)
        with warnings.catch_warnings():  # deprecated in favour of reduce_scatter_single, still used by FSDP
            warnings.simplefilter("ignore", FutureWarning)
            dist.reduce_scatter_tensor(shard, value.repeat(size), op=dist.ReduceOp.AVG, group=group)
        results["reduce_scatter_tensor"] = shard
        listed = torch.empty(numel, dtype=dtype)
        dist.reduce_scatter(listed, [value.clone() for _ in range(size)], op=dist.ReduceOp.AVG, group=group)
        results["reduce_scatter"] = listed
        for op, got in results.items():
            error = (got.double() - expected).abs().max().item()
            if error > 1e-5 * expected.abs().max().item():
                problems.append(f"{op} AVG {str(dtype).removeprefix('torch.')}: off by {error:.3g}")
    return problems
