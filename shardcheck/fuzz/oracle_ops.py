"""The ops the oracle's programs are made of: aten ops from the checker's rule tables, every
c10d collective in each of its call forms, and the idioms of real training code (branches on
the group rank, slices by rank, Python numbers read from tensors, in-place ops on views,
contributions accumulated on one rank only).

Each op is ``fn(env, *tensors, **params) -> Tensor``; ``g`` names a group ("tp", "dp" or
"world"). With a group of size 1 (the one-rank run) a collective is what torch.distributed
makes of it there: the identity. In "meta" mode collectives only allocate their outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


class Env:
    """What a step sees of the ranks: size, rank and process group of each group name.

    ``mode`` is "dist" (real Gloo ranks), "single" (the one-rank run: every size 1) or "meta"
    (shapes only: collectives allocate their outputs and move nothing; the values are junk).
    """

    def __init__(self, mode: str, sizes: dict[str, int], ranks: dict[str, int],
                 groups: dict[str, Any] | None = None) -> None:
        self.mode, self.sizes, self.ranks, self.groups = mode, sizes, ranks, groups or {}

    def size(self, group: str) -> int:
        return self.sizes[group]

    def rank(self, group: str) -> int:
        """This rank's index in ``group``; on real ranks read as user code reads it."""
        return dist.get_rank(self.groups[group]) if self.mode == "dist" else self.ranks[group]

    def group(self, group: str) -> Any:
        return self.groups[group]

    def global_rank(self, group: str, index: int) -> int:
        return dist.get_global_rank(self.groups[group], index)

    @property
    def moves_data(self) -> bool:
        return self.mode == "dist"

    def item(self, t: torch.Tensor) -> float:
        return 1.0 if self.mode == "meta" else t.item()


def _buffer(x: torch.Tensor) -> torch.Tensor:
    """A contiguous receive buffer shaped like ``x`` (Gloo needs contiguous ones)."""
    return x.new_empty(x.shape)


def _moves(env: Env, g: str) -> bool:
    return env.moves_data and env.size(g) > 1


# --- collectives: torch.distributed's in-place API -----------------------------------------

def all_reduce(env: Env, x, g: str, op: str = "sum"):
    y = x.clone()
    if _moves(env, g):
        dist.all_reduce(y, op=_REDUCE_OPS[op], group=env.group(g))
    return y


def all_gather_list(env: Env, x, g: str, dim: int = 0):
    outs = [_buffer(x) for _ in range(env.size(g))]
    if _moves(env, g):
        dist.all_gather(outs, x.contiguous(), group=env.group(g))
    elif env.mode == "single":
        outs[0].copy_(x)
    return torch.cat(outs, dim)


def all_gather_into_tensor(env: Env, x, g: str):
    out = x.new_empty((x.shape[0] * env.size(g), *x.shape[1:]))
    if _moves(env, g):
        dist.all_gather_into_tensor(out, x.contiguous(), group=env.group(g))
    elif env.mode == "single":
        out.copy_(x)
    return out


def gather_last_dim(env: Env, x, g: str):
    """Megatron's gather along the last dim: gather on dim 0, then chunk and cat."""
    return torch.cat(all_gather_into_tensor(env, x, g).chunk(env.size(g), 0), dim=-1)


def reduce_scatter_tensor(env: Env, x, g: str, op: str = "sum"):
    out = x.new_empty((x.shape[0] // env.size(g), *x.shape[1:]))
    if x.shape[0] % env.size(g):
        raise ValueError("dim 0 does not split")
    if _moves(env, g):
        dist.reduce_scatter_tensor(out, x.contiguous(), op=_REDUCE_OPS[op], group=env.group(g))
    elif env.mode == "single":
        out.copy_(x)
    return out


def reduce_scatter_list(env: Env, x, g: str, dim: int = 0):
    pieces = list(x.chunk(env.size(g), dim))
    if len(pieces) != env.size(g) or x.shape[dim] % env.size(g):
        raise ValueError("dim does not split")
    out = _buffer(pieces[0])
    if _moves(env, g):
        dist.reduce_scatter(out, pieces, group=env.group(g))
    elif env.mode == "single":
        out.copy_(pieces[0])
    return out


def reduce_scatter_last_dim(env: Env, x, g: str):
    """Megatron's reduce-scatter along the last dim: split the last dim, stack the pieces on
    dim 0, reduce-scatter along dim 0, reshape."""
    n = env.size(g)
    target = (*x.shape[:-1], x.shape[-1] // n)
    flat = x.reshape(-1, x.shape[-1])
    stacked = torch.cat(torch.split(flat, x.shape[-1] // n, dim=1), dim=0)
    return reduce_scatter_tensor(env, stacked, g).reshape(target)


def broadcast(env: Env, x, g: str):
    y = x.clone()
    if _moves(env, g):
        dist.broadcast(y, src=env.global_rank(g, 0), group=env.group(g))
    return y


def _chunks(x, n: int, dim: int) -> list[torch.Tensor]:
    """``x`` cut into ``n`` equal contiguous pieces along ``dim`` (a ValueError when it can't be)."""
    if x.shape[dim] % n:
        raise ValueError("dim does not split")
    return [c.contiguous() for c in x.chunk(n, dim)]


def scatter(env: Env, x, g: str, dim: int = 0):
    """The group's first rank scatters the chunks of its value along ``dim``."""
    pieces = _chunks(x, env.size(g), dim)
    out = _buffer(pieces[0])
    if _moves(env, g):
        dist.scatter(out, pieces if env.rank(g) == 0 else None, src=env.global_rank(g, 0), group=env.group(g))
    elif env.mode == "single":
        out.copy_(pieces[0])
    return out


def gather(env: Env, x, g: str):
    """The group's first rank gathers every rank's value (stacked on dim 0); the others keep
    zeros of that shape."""
    n = env.size(g)
    if not _moves(env, g):
        return torch.cat([x.clone()] * n) if env.mode == "meta" else x.clone()
    first = env.rank(g) == 0
    outs = [_buffer(x) for _ in range(n)] if first else None
    dist.gather(x.contiguous(), outs, dst=env.global_rank(g, 0), group=env.group(g))
    return torch.cat(outs) if first else x.new_zeros((x.shape[0] * n, *x.shape[1:]))


def reduce(env: Env, x, g: str):
    y = x.clone()
    if _moves(env, g):
        dist.reduce(y, dst=env.global_rank(g, 0), group=env.group(g))
    return y


def all_to_all_single(env: Env, x, g: str):
    out = _buffer(x)
    if x.shape[0] % env.size(g):
        raise ValueError("dim 0 does not split")
    if _moves(env, g):
        dist.all_to_all_single(out, x.contiguous(), group=env.group(g))
    elif env.mode == "single":
        out.copy_(x)
    return out


def all_to_all_list(env: Env, x, g: str, dim: int = 0):
    """Rank k sends its ``dim``-chunk j to rank j and stacks what it receives along ``dim``."""
    pieces = _chunks(x, env.size(g), dim)
    outs = [_buffer(p) for p in pieces]
    if _moves(env, g):
        dist.all_to_all(outs, pieces, group=env.group(g))
    elif env.mode == "single":
        outs[0].copy_(pieces[0])
    return torch.cat(outs, dim)


def all_to_all_list_hp_to_sp(env: Env, x, g: str):
    """hp2sp in the list form: rank k sends its dim-0 chunk j to rank j and joins what it
    receives along dim 1."""
    pieces = _chunks(x, env.size(g), 0)
    outs = [_buffer(p) for p in pieces]
    if _moves(env, g):
        dist.all_to_all(outs, pieces, group=env.group(g))
    elif env.mode == "single":
        outs[0].copy_(pieces[0])
    return torch.cat(outs, 1)


def sp_to_hp(env: Env, x, g: str):
    """Megatron's all_to_all_sp2hp: [s/n, h] sharded on s to [s, h/n] sharded on h."""
    n = env.size(g)
    stacked = torch.cat(torch.split(x, x.shape[-1] // n, dim=1), dim=0)
    return all_to_all_single(env, stacked, g)


def hp_to_sp(env: Env, x, g: str):
    """Megatron's all_to_all_hp2sp: [s, h/n] sharded on h to [s/n, h] sharded on s."""
    n = env.size(g)
    out = all_to_all_single(env, x, g)
    return torch.cat(torch.split(out, out.shape[0] // n, dim=0), dim=1)


def exchange(env: Env, x, g: str):
    """Batched P2P: send to the next rank of the group, receive from the previous one."""
    y = _buffer(x)
    if not _moves(env, g):
        return y.copy_(x)
    n, r = env.size(g), env.rank(g)
    ops = [dist.P2POp(dist.isend, x.contiguous(), env.global_rank(g, (r + 1) % n), env.group(g)),
           dist.P2POp(dist.irecv, y, env.global_rank(g, (r - 1) % n), env.group(g))]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return y


def send_recv(env: Env, x, g: str):
    """Pipeline-style: the group's first rank sends its value to each other rank (send/recv)."""
    y = x.clone(memory_format=torch.contiguous_format)  # Gloo receives into contiguous buffers only
    if not _moves(env, g):
        return y
    if env.rank(g) == 0:
        for k in range(1, env.size(g)):
            dist.send(x.contiguous(), dst=env.global_rank(g, k), group=env.group(g))
    else:
        dist.recv(y, src=env.global_rank(g, 0), group=env.group(g))
    return y


# --- collectives: the functional API ---------------------------------------------------------

def _functional(env: Env, g: str, x, make: Callable):
    if not _moves(env, g):
        return x.clone()
    return fc.wait_tensor(make(env.group(g)))


def f_all_reduce(env: Env, x, g: str):
    return _functional(env, g, x, lambda group: fc.all_reduce(x, "sum", group))


def f_all_gather(env: Env, x, g: str, dim: int = 0):
    if env.mode == "meta":
        return torch.cat([x] * env.size(g), dim)
    return _functional(env, g, x, lambda group: fc.all_gather_tensor(x.contiguous(), dim, group))


def f_reduce_scatter(env: Env, x, g: str, dim: int = 0):
    if x.shape[dim] % env.size(g):
        raise ValueError("dim does not split")
    if env.mode == "meta":
        return x.chunk(env.size(g), dim)[0].clone()
    return _functional(env, g, x, lambda group: fc.reduce_scatter_tensor(x.contiguous(), "sum", dim, group))


def f_broadcast(env: Env, x, g: str):
    return _functional(env, g, x, lambda group: fc.broadcast(x.contiguous(), 0, group))


def f_all_to_all(env: Env, x, g: str):
    if x.shape[0] % env.size(g):
        raise ValueError("dim 0 does not split")
    return _functional(env, g, x, lambda group: fc.all_to_all_single(x.contiguous(), None, None, group))


def f_hp_to_sp(env: Env, x, g: str):
    """all_to_all_hp2sp through the functional all-to-all: its dim-0 blocks joined along dim 1."""
    out = f_all_to_all(env, x, g)
    return torch.cat(torch.split(out, out.shape[0] // env.size(g), dim=0), dim=1)


# --- idioms ----------------------------------------------------------------------------------

def slice_by_rank(env: Env, x, g: str, dim: int = 0):
    """This rank's chunk along ``dim`` (the group's rank picks it)."""
    n = env.size(g)
    if x.shape[dim] % n:
        raise ValueError("dim does not split")
    return x.chunk(n, dim)[env.rank(g)]


def add_on_first_rank(env: Env, x, b, g: str):
    """``if rank == 0: x = x + b``: a term added once to a partial sum."""
    return x + b if env.rank(g) == 0 else x.clone()


def accumulate_on_first_rank(env: Env, x, g: str):
    """A buffer of zeros that only the group's first rank accumulates into."""
    acc = torch.zeros_like(x)
    if env.rank(g) == 0:
        acc += x
    return acc


def zeros_plus(env: Env, x):
    """``acc = zeros; acc += x`` on every rank."""
    acc = torch.zeros_like(x)
    acc += x
    return acc


def scale_by_item(env: Env, x, s):
    """A Python number read from a tensor scales another (``x * loss_scale.item()``)."""
    return x * env.item(s.sum())


def add_into_view(env: Env, x, y, dim: int = 0):
    """In place on a view: ``out[:k] += y[:k]`` along ``dim`` (half of the local extent)."""
    out = x.clone()
    k = x.shape[dim] // 2
    out.narrow(dim, 0, k).add_(y.narrow(dim, 0, k))
    return out


def copy_into(env: Env, x, y):
    """``out.copy_(y)`` into a fresh buffer shaped like ``x``."""
    return _buffer(x).copy_(y)


# --- aten ops --------------------------------------------------------------------------------

def _masked_roundtrip(env: Env, x, y):
    """The elements of x where y > 0, taken out (``masked_select``) and put back into zeros
    (``masked_scatter``): x where y > 0, else 0."""
    mask = y > 0
    return torch.zeros_like(x).masked_scatter(mask, x.masked_select(mask))


def _masked_sum(env: Env, x, y):
    """The sum of the elements of x where y > 0, as a [1, 1] tensor."""
    return x.masked_select(y > 0).sum().reshape(1, 1)


def _index(x, dim: int):
    idx = torch.arange(x.shape[dim] - 1, -1, -1, device=x.device)
    return x.index_select(dim, idx)


@dataclass(frozen=True)
class OpSpec:
    """An op, how many tensors it takes, and the choices of each parameter."""

    fn: Callable
    arity: int
    params: tuple[tuple[str, tuple], ...] = ()


GROUPS = ("tp", "dp", "world")
DIMS = (0, 1)

SPECS: dict[str, OpSpec] = {
    # elementwise
    "add": OpSpec(lambda env, a, b: a + b, 2),
    "sub": OpSpec(lambda env, a, b: a - b, 2),
    "mul": OpSpec(lambda env, a, b: a * b, 2),
    "div": OpSpec(lambda env, a, b: a / (b * b + 1), 2),
    "neg": OpSpec(lambda env, a: -a, 1),
    "scale": OpSpec(lambda env, a, c: a * c, 1, (("c", (0.5, 3.0)),)),
    "gelu": OpSpec(lambda env, a: F.gelu(a), 1),
    "exp": OpSpec(lambda env, a: torch.exp(a), 1),
    "tanh": OpSpec(lambda env, a: torch.tanh(a), 1),
    # reductions
    "sum": OpSpec(lambda env, a, dim: a.sum(dim, keepdim=True), 1, (("dim", DIMS),)),
    "mean": OpSpec(lambda env, a, dim: a.mean(dim, keepdim=True), 1, (("dim", DIMS),)),
    "amax": OpSpec(lambda env, a, dim: a.amax(dim, keepdim=True), 1, (("dim", DIMS),)),
    # matmul
    "matmul": OpSpec(lambda env, a, b: a @ b, 2),
    "matmul_t": OpSpec(lambda env, a, b: a @ b.t(), 2),
    # views, copies, casts
    "transpose": OpSpec(lambda env, a: a.t(), 1),
    "flatten_view": OpSpec(lambda env, a: a.contiguous().view(-1).view(a.shape), 1),
    "detach": OpSpec(lambda env, a: a.detach(), 1),
    "cast": OpSpec(lambda env, a: a.float().double(), 1),
    "clone": OpSpec(lambda env, a: a.clone(), 1),
    "copy_into": OpSpec(copy_into, 2),
    # cat, split, indexing
    "cat": OpSpec(lambda env, a, b, dim: torch.cat([a, b], dim), 2, (("dim", DIMS),)),
    "chunk": OpSpec(lambda env, a, dim, i: a.chunk(2, dim)[i], 1, (("dim", DIMS), ("i", (0, 1)))),
    "narrow": OpSpec(lambda env, a, dim: a.narrow(dim, 0, 1), 1, (("dim", DIMS),)),
    "select_row": OpSpec(lambda env, a: a[0].unsqueeze(0), 1),
    "index_select": OpSpec(lambda env, a, dim: _index(a, dim), 1, (("dim", DIMS),)),
    "masked_roundtrip": OpSpec(_masked_roundtrip, 2),
    "masked_sum": OpSpec(_masked_sum, 2),
    # softmax and norms
    "softmax": OpSpec(lambda env, a, dim: torch.softmax(a, dim), 1, (("dim", DIMS),)),
    "log_softmax": OpSpec(lambda env, a, dim: torch.log_softmax(a, dim), 1, (("dim", DIMS),)),
    "layer_norm": OpSpec(lambda env, a: F.layer_norm(a, a.shape[-1:]), 1),
    # in place
    "add_": OpSpec(lambda env, a, b: a.clone().add_(b), 2),
    "add_into_view": OpSpec(add_into_view, 2, (("dim", DIMS),)),
    # collectives
    "all_reduce": OpSpec(all_reduce, 1, (("g", GROUPS), ("op", ("sum", "avg", "max", "min", "product")))),
    "all_gather_list": OpSpec(all_gather_list, 1, (("g", GROUPS), ("dim", DIMS))),
    "all_gather_into_tensor": OpSpec(all_gather_into_tensor, 1, (("g", GROUPS),)),
    "gather_last_dim": OpSpec(gather_last_dim, 1, (("g", GROUPS),)),
    "reduce_scatter_tensor": OpSpec(reduce_scatter_tensor, 1, (("g", GROUPS), ("op", ("sum", "avg")))),
    "reduce_scatter_list": OpSpec(reduce_scatter_list, 1, (("g", GROUPS), ("dim", DIMS))),
    "reduce_scatter_last_dim": OpSpec(reduce_scatter_last_dim, 1, (("g", GROUPS),)),
    "broadcast": OpSpec(broadcast, 1, (("g", GROUPS),)),
    "scatter": OpSpec(scatter, 1, (("g", GROUPS), ("dim", DIMS))),
    "gather": OpSpec(gather, 1, (("g", GROUPS),)),
    "reduce": OpSpec(reduce, 1, (("g", GROUPS),)),
    "all_to_all_single": OpSpec(all_to_all_single, 1, (("g", GROUPS),)),
    "all_to_all_list": OpSpec(all_to_all_list, 1, (("g", GROUPS), ("dim", DIMS))),
    "all_to_all_list_hp_to_sp": OpSpec(all_to_all_list_hp_to_sp, 1, (("g", GROUPS),)),
    "sp_to_hp": OpSpec(sp_to_hp, 1, (("g", GROUPS),)),
    "hp_to_sp": OpSpec(hp_to_sp, 1, (("g", GROUPS),)),
    "exchange": OpSpec(exchange, 1, (("g", GROUPS),)),
    "send_recv": OpSpec(send_recv, 1, (("g", GROUPS),)),
    "f_all_reduce": OpSpec(f_all_reduce, 1, (("g", GROUPS),)),
    "f_all_gather": OpSpec(f_all_gather, 1, (("g", GROUPS), ("dim", DIMS))),
    "f_reduce_scatter": OpSpec(f_reduce_scatter, 1, (("g", GROUPS), ("dim", DIMS))),
    "f_broadcast": OpSpec(f_broadcast, 1, (("g", GROUPS),)),
    "f_all_to_all": OpSpec(f_all_to_all, 1, (("g", GROUPS),)),
    "f_hp_to_sp": OpSpec(f_hp_to_sp, 1, (("g", GROUPS),)),
    # idioms
    "slice_by_rank": OpSpec(slice_by_rank, 1, (("g", GROUPS), ("dim", DIMS))),
    "add_on_first_rank": OpSpec(add_on_first_rank, 2, (("g", GROUPS),)),
    "accumulate_on_first_rank": OpSpec(accumulate_on_first_rank, 1, (("g", GROUPS),)),
    "zeros_plus": OpSpec(zeros_plus, 1),
    "scale_by_item": OpSpec(scale_by_item, 2),
}

COLLECTIVES = ("all_reduce", "all_gather_list", "all_gather_into_tensor", "gather_last_dim",
               "reduce_scatter_tensor", "reduce_scatter_list", "reduce_scatter_last_dim", "broadcast",
               "scatter", "gather", "reduce", "all_to_all_single", "all_to_all_list",
               "all_to_all_list_hp_to_sp", "sp_to_hp", "hp_to_sp", "exchange", "send_recv", "f_all_reduce",
               "f_all_gather", "f_reduce_scatter", "f_broadcast", "f_all_to_all", "f_hp_to_sp")

OPS: dict[str, Callable] = {name: spec.fn for name, spec in SPECS.items()}
