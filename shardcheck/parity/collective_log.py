"""Log every torch.distributed collective a rank enters, and read the logs back to tell hangs from desyncs.

Inside a pool worker, :func:`install` wraps the public ``torch.distributed`` collectives so that
each call first appends one line (group ranks, op, dtype and shape) to the rank's log file. The
parent reads the files after a job: ranks whose calls on a group differ at the same position
are a *desync*; a rank stuck in a collective the others never entered is a *hang*.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
    "reduce", "gather", "scatter", "barrier", "send", "recv", "isend", "irecv",
    "_all_gather_base", "_reduce_scatter_base",
)
# Ops whose tensors may legitimately differ in shape between ranks: compare their names only.
_P2P = {"send", "recv", "isend", "irecv"}
_SHAPE_FREE = {"all_to_all", "all_to_all_single", "gather", "scatter", "all_gather_object",
               "broadcast_object_list", "barrier", *_P2P}


@dataclass(frozen=True)
class Call:
    """One collective entered by a rank."""

    group: tuple[int, ...]
    op: str
    signature: str

    def __str__(self) -> str:
        return f"{self.op}({self.signature}) on group {list(self.group)}"


class _Log:
    """This process's log file; :meth:`restart` truncates it at the start of a job."""

    def __init__(self) -> None:
        self.file = None
        self.path: Path | None = None
        self._ranks: dict[dist.ProcessGroup, tuple[int, ...]] = {}

    def restart(self, path: Path) -> None:
        if self.file is not None:
            self.file.close()
        self.path = path
        self.file = open(path, "w", buffering=1)  # noqa: SIM115 - kept open across calls

    def write(self, op: str, args: tuple, kwargs: dict) -> None:
        if self.file is None:
            return
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        self.file.write(f"{','.join(map(str, self._ranks_of(group)))}\t{op}\t{_signature(op, args)}\n")

    def _ranks_of(self, group: dist.ProcessGroup | None) -> tuple[int, ...]:
        group = group or dist.group.WORLD
        if group not in self._ranks:  # keyed by the group itself: ids of destroyed groups get reused
            self._ranks[group] = tuple(dist.get_process_group_ranks(group))
        return self._ranks[group]


LOG = _Log()


def _signature(op: str, args: tuple) -> str:
    if op in _SHAPE_FREE:
        return ""
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if tensor is None:
        tensor = next((a[0] for a in args if isinstance(a, list | tuple) and a
                       and isinstance(a[0], torch.Tensor)), None)
    return "" if tensor is None else f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _logged(op: str, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        LOG.write(op, args, kwargs)
        return original(*args, **kwargs)

    wrapper.__shardcheck_original__ = original
    return wrapper


def install() -> None:
    """Wrap the torch.distributed collectives of this process so they are logged.

    ``isend``/``irecv`` are also replaced where ``P2POp`` looks them up, since it accepts only
    those exact functions (Megatron's pipeline schedules build P2POps from ``dist.isend``).
    """
    for op in COLLECTIVES:
        original = getattr(dist, op, None)
        if original is not None and not hasattr(original, "__shardcheck_original__"):
            setattr(dist, op, _logged(op, original))
            if op in ("isend", "irecv"):
                setattr(distributed_c10d, op, getattr(dist, op))


def read(path: Path) -> list[Call]:
    """The collectives a rank entered, in order, from its log file."""
    if not path.exists():
        return []
    calls = []
    for line in path.read_text().splitlines():
        ranks, op, signature = line.split("\t")
        calls.append(Call(tuple(int(r) for r in ranks.split(",")), op, signature))
    return calls


def find_desync(logs: dict[int, list[Call]]) -> str | None:
    """Describe the first position where members of a group entered different collectives."""
    groups = sorted({c.group for calls in logs.values() for c in calls if c.op not in _P2P})
    for group in groups:
        per_rank = {r: [c for c in logs.get(r, []) if c.group == group and c.op not in _P2P]
                    for r in group}
        for position in range(min(len(calls) for calls in per_rank.values())):
            seen = {r: calls[position] for r, calls in per_rank.items()}
            if len({(c.op, c.signature) for c in seen.values()}) > 1:
                detail = "; ".join(f"rank {r}: {c.op}({c.signature})" for r, c in seen.items())
                return f"desync on group {list(group)} at its collective #{position + 1}: {detail}"
    return None


def last_entered(logs: dict[int, list[Call]], ranks: Iterable[int]) -> dict[int, str]:
    """For each rank, its last collective entered and how many it entered, as one phrase."""
    out = {}
    for rank in ranks:
        calls = logs.get(rank, [])
        out[rank] = f"#{len(calls)} {calls[-1]}" if calls else "no collective entered"
    return out
