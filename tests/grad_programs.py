"""Small distributed training steps, correct and buggy, for the gradient-type tests.

Every program runs on real Gloo ranks (``spawn_ranks``), in plain ``torch.distributed`` with
Megatron-style autograd Functions for the tensor-parallel collectives. Each rank also computes
the single-process reference of the same step, so a test can prove that the buggy variant's
gradient really differs (and that the correct variant's matches).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardcheck as sc

HIDDEN, FFN, SEQ, BATCH = 8, 16, 8, 2
HEADS, HEAD_DIM = 8, 4


# ---- Megatron-style collectives as autograd Functions --------------------------------------


class CopyToRegion(torch.autograd.Function):
    """Identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_dim0(x, group):
    out = torch.empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]), dtype=x.dtype)
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_dim0(x, group):
    out = torch.empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]), dtype=x.dtype)
    dist.reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class GatherSequence(torch.autograd.Function):
    """Sequence-parallel all-gather along dim 0; reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """Sequence-parallel reduce-scatter along dim 0; all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim0(grad, ctx.group), None


PLAIN = {"copy": CopyToRegion.apply, "reduce": ReduceFromRegion.apply}


def megatron_mappings() -> dict:
    """megatron-core's own autograd Functions for copy-to and reduce-from the tp region."""
    from megatron.core.tensor_parallel import mappings

    return {
        "copy": lambda x, g: mappings.copy_to_tensor_model_parallel_region(x, group=g),
        "reduce": lambda x, g: mappings.reduce_from_tensor_model_parallel_region(x, group=g),
    }


def collectives(kind: str) -> dict:
    return megatron_mappings() if kind == "megatron" else PLAIN


# ---- process groups -------------------------------------------------------------------------


def tp_dp_groups(tp_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's tp and dp groups in Megatron order (tp fastest); every rank makes them all."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = {}
    for start in range(0, world, tp_size):
        ranks = list(range(start, start + tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["tp"] = group
    for offset in range(tp_size):
        ranks = list(range(offset, world, tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["dp"] = group
    return mine["tp"], mine["dp"]


def shard(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's block of ``t`` along ``dim`` on ``group``."""
    return t.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].clone()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def found() -> list[tuple[str, str | None, str | None]]:
    """(rule, parameter, axis) of every violation the region recorded."""
    return [(v.rule, getattr(v, "param", None), getattr(v, "axis", None)) for v in sc.violations()]


def on(axis: str, types: dict[str, str]) -> dict[str, dict[str, str]]:
    return {name: {axis: placement} for name, placement in types.items()}


# ---- 1. sequence-parallel MLP: layer-norm gradient all-reduced over tp or not --------------


class SequenceParallelMLP(nn.Module):
    """LayerNorm on the local sequence shard, column- then row-parallel linear."""

    def __init__(self, global_model: nn.Module | None, group) -> None:
        super().__init__()
        self.group = group
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.fc2 = nn.Linear(FFN, HIDDEN, bias=False)
        if global_model is not None:
            self.load_shards(global_model)

    def load_shards(self, full: nn.Module) -> None:
        with torch.no_grad():
            self.norm.weight.copy_(full.norm.weight)
            self.norm.bias.copy_(full.norm.bias)
            self.fc1.weight = nn.Parameter(shard(full.fc1.weight, 0, self.group))
            self.fc2.weight = nn.Parameter(shard(full.fc2.weight, 1, self.group))

    def forward(self, x_local):
        y = GatherSequence.apply(self.norm(x_local), self.group)
        z = self.fc2(F.gelu(self.fc1(y)))
        return ReduceScatterSequence.apply(z, self.group)


def _full_mlp() -> nn.Module:
    torch.manual_seed(0)
    model = SequenceParallelMLP(None, None)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


def _mlp_reference(model: nn.Module, x: torch.Tensor) -> None:
    z = model.fc2(F.gelu(model.fc1(model.norm(x))))
    z.pow(2).sum().backward()


MLP_TYPES = {"norm.weight": "R", "norm.bias": "R", "fc1.weight": "S(0)", "fc2.weight": "S(1)"}


def sequence_parallel_mlp(reduce_norm_grads: bool) -> dict:
    """Loss: sum of squares of the local output shard (a P loss: sum semantics over tp).

    Checked by the optimizer step's pre-hook.
    """
    group = dist.group.WORLD
    full = _full_mlp()
    x = torch.randn(SEQ, HIDDEN)
    _mlp_reference(full, x)
    model = SequenceParallelMLP(full, group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        sc.annotate_parameters(model, on("tp", MLP_TYPES))
        x_local = sc.annotate(shard(x, 0, group), tp=sc.S(0))
        model(x_local).pow(2).sum().backward()
        if reduce_norm_grads:
            for p in model.norm.parameters():
                dist.all_reduce(p.grad, group=group)
        optimizer.step()
    return {
        "norm_diff": max_diff(model.norm.weight.grad, full.norm.weight.grad),
        "fc1_diff": max_diff(model.fc1.weight.grad, shard(full.fc1.weight.grad, 0, group)),
        "fc2_diff": max_diff(model.fc2.weight.grad, shard(full.fc2.weight.grad, 1, group)),
        "violations": found(),
    }


# ---- 2./3. attention-style heads split over tp ---------------------------------------------


class HeadsModel(nn.Module):
    """Column-parallel q projection split into heads, a per-head op, row-parallel output.

    ``q_norm`` is a layer norm over head_dim whose weight is shared by every head;
    ``head_scale`` holds one value per local head.
    """

    def __init__(self, full: nn.Module | None, group, kind: str = "plain") -> None:
        super().__init__()
        self.group, self.comm = group, collectives(kind)
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.q_norm = nn.LayerNorm(HEAD_DIM)
        self.head_scale = nn.Parameter(torch.ones(HEADS))
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.out_norm = nn.LayerNorm(HIDDEN, bias=False)
        if full is not None:
            self.load_shards(full)

    def load_shards(self, full: nn.Module) -> None:
        with torch.no_grad():
            for name in ("q_norm.weight", "q_norm.bias", "out_norm.weight"):
                self.get_parameter(name).copy_(full.get_parameter(name))
            self.q_proj.weight = nn.Parameter(shard(full.q_proj.weight, 0, self.group))
            self.head_scale = nn.Parameter(shard(full.head_scale, 0, self.group))
            self.o_proj.weight = nn.Parameter(shard(full.o_proj.weight, 1, self.group))

    def forward(self, x):
        if self.group is not None:
            x = self.comm["copy"](x, self.group)
        q = self.q_proj(x)
        q = q.view(*q.shape[:-1], -1, HEAD_DIM)
        q = self.q_norm(q) * self.head_scale[:, None]
        out = self.o_proj(q.flatten(-2))
        if self.group is not None:
            out = self.comm["reduce"](out, self.group)
        return self.out_norm(out)


def _full_heads() -> nn.Module:
    torch.manual_seed(0)
    model = HeadsModel(None, None)
    with torch.no_grad():
        for p in (model.q_norm.weight, model.head_scale, model.out_norm.weight):
            p.uniform_(0.5, 1.5)
    return model


def _heads_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()


HEADS_TYPES = {"q_proj.weight": "S(0)", "q_norm.weight": "R", "q_norm.bias": "R",
               "head_scale": "S(0)", "o_proj.weight": "S(1)", "out_norm.weight": "R"}


def head_norm(sum_norm_grads: bool, kind: str = "plain") -> dict:
    """The head_dim norm weight's gradient is partial over tp: summed (correct) or not.

    Checked explicitly with ``sc.check_gradients``; its findings are returned too.
    """
    group = dist.group.WORLD
    full = _full_heads()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    _heads_step(full, x)
    model = HeadsModel(full, group, kind)
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        sc.annotate_parameters(model, on("tp", HEADS_TYPES))
        _heads_step(model, sc.annotate(x, tp=sc.R))
        if sum_norm_grads:
            for p in model.q_norm.parameters():
                dist.all_reduce(p.grad, group=group)
        returned = [(f.rule, f.param, f.axis) for f in sc.check_gradients(model)]
    return {
        "q_norm_diff": max_diff(model.q_norm.weight.grad, full.q_norm.weight.grad),
        "q_proj_diff": max_diff(model.q_proj.weight.grad, shard(full.q_proj.weight.grad, 0, group)),
        "returned": returned,
        "violations": found(),
    }


def clip_grad_norm(model: nn.Module, max_norm: float, group, tp_rank: int,
                   foreach: bool = False) -> torch.Tensor:
    """Megatron-style clipping: skip tp duplicates, sum squares, all-reduce over tp.

    ``foreach`` takes the per-gradient norms with ``torch._foreach_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does, and squares them.
    """
    grads = [p.grad for p in model.parameters()
             if getattr(p, "tensor_model_parallel", False) or tp_rank == 0]
    if foreach:
        total = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
    else:
        total = torch.stack([g.pow(2).sum() for g in grads]).sum()
    dist.all_reduce(total, group=group)
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        p.grad.mul_(coef)
    return norm


def count_zeros(model: nn.Module, group, tp_rank: int) -> int:
    """Megatron's num-zeros: each gradient's ``numel() - count_nonzero``, tp duplicates
    skipped, summed, all-reduced over tp."""
    total = torch.zeros(1, dtype=torch.int64)
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            total = p.grad.numel() - torch.count_nonzero(p.grad) + total
    dist.all_reduce(total, group=group)
    return int(total.item())


@contextmanager
def _checked_heads_step(types: dict[str, str]):
    """The heads model stepped in one process (``full``) and on the tp ranks under the checker
    with the given parameter types, q_norm's gradients all-reduced; yields both and the group."""
    group = dist.group.WORLD
    full = _full_heads()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    _heads_step(full, x)
    model = HeadsModel(full, group)
    for name, p in model.named_parameters():
        p.tensor_model_parallel = types[name].startswith("S")
    with sc.typecheck(sc.Mesh(tp=group), mode="collect"):
        sc.annotate_parameters(model, on("tp", types))
        _heads_step(model, sc.annotate(x, tp=sc.R))
        for p in model.q_norm.parameters():
            dist.all_reduce(p.grad, group=group)
        yield full, model, group


def zero_count(count_replicated_once: bool) -> dict:
    """Zeros in the gradients of the heads model, counted Megatron's way, on tp ranks against
    one process; ``count_replicated_once=False`` drops the duplicate filter. The first two
    entries of every replicated gradient are zeroed (counted twice, they show twice)."""
    with _checked_heads_step(HEADS_TYPES) as (full, model, group):
        filtering_rank = dist.get_rank(group) if count_replicated_once else 0
        for name, p in (*model.named_parameters(), *full.named_parameters()):
            if HEADS_TYPES[name] == "R":
                p.grad.view(-1)[:2] = 0
        zeros = count_zeros(model, group, filtering_rank)
    reference = sum(int((p.grad == 0).sum()) for p in full.parameters())
    return {"zeros": zeros, "reference": reference, "violations": found()}


def per_head_scale(head_scale_type: str, count_replicated_once: bool = True,
                   foreach: bool = False) -> dict:
    """A per-head parameter declared S(0) (correct) or R (misdeclared), then clipped.

    ``count_replicated_once=False`` drops the duplicate filter, so R parameters are counted
    on every tp rank.
    """
    with _checked_heads_step(dict(HEADS_TYPES, head_scale=head_scale_type)) as (full, model, group):
        ref_norm = torch.cat([p.grad.flatten() for p in full.parameters()]).norm()
        filtering_rank = dist.get_rank(group) if count_replicated_once else 0
        sc.check_gradients(model)
        norm = clip_grad_norm(model, 0.5, group, filtering_rank, foreach)
    return {
        "head_scale_diff": max_diff(
            model.head_scale.grad, shard(full.head_scale.grad, 0, group) * 0.5 / ref_norm),
        "norm": norm.item(),
        "ref_norm": ref_norm.item(),
        "violations": found(),
    }


# ---- 4. data-parallel gradient all-reduce present or missing -------------------------------


def data_parallel(all_reduce_grads: bool, axes: tuple[str, ...] = ("dp",)) -> dict:
    """A replicated linear model on per-rank batches; DDP-style averaged gradients. Several
    ``axes`` name the same group (Megatron's dp and ep at dp2-ep2): the batch differs on each,
    and the one all-reduce reduces over each."""
    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.Tanh(), nn.Linear(FFN, 1))
    x, y = torch.randn(BATCH * world, HIDDEN), torch.randn(BATCH * world, 1)
    F.mse_loss(full(x), y).backward()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.Tanh(), nn.Linear(FFN, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with sc.typecheck(sc.Mesh(**dict.fromkeys(axes, group)), mode="collect"):
        sc.annotate_parameters(model, **dict.fromkeys(axes, sc.R))
        x_local = sc.annotate(x.chunk(world)[rank], **dict.fromkeys(axes, sc.V))
        y_local = sc.annotate(y.chunk(world)[rank], **dict.fromkeys(axes, sc.V))
        F.mse_loss(model(x_local), y_local).backward()
        if all_reduce_grads:
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)
        optimizer.step()
    return {
        "max_diff": max(max_diff(p.grad, q.grad)
                        for p, q in zip(model.parameters(), full.parameters(), strict=True)),
        "violations": found(),
    }


# ---- 5. Megatron-style flat gradient buffer with per-parameter views -----------------------


def attach_main_grads(model: nn.Module) -> torch.Tensor:
    """One zeroed flat buffer; each parameter's ``main_grad`` views its slice of it.

    A post-accumulate hook moves each new ``.grad`` into ``main_grad``, as Megatron's DDP does.
    """
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.main_grad = buffer[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
        p.register_post_accumulate_grad_hook(_move_grad_to_main_grad)
    return buffer


def _move_grad_to_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad.data)
    param.grad = None


def flat_buffer(reduced_numel: str) -> dict:
    """tp=2 x dp=2: the buffer is scaled and summed over dp in place, whole or ('short')
    without its tail."""
    tp, dp = tp_dp_groups(2)
    dp_size = dist.get_world_size(dp)
    full = _full_heads()
    torch.manual_seed(1)
    x = torch.randn(BATCH * dp_size, SEQ, HIDDEN)
    _heads_step(full, x)  # a mean over the global batch
    model = HeadsModel(full, tp)
    with sc.typecheck(sc.Mesh(tp=tp, dp=dp), mode="collect"):
        buffer = attach_main_grads(model)
        sc.annotate_parameters(model, on("tp", HEADS_TYPES), dp=sc.R)
        x_local = sc.annotate(shard(x, 0, dp), tp=sc.R, dp=sc.V)
        _heads_step(model, x_local)
        for p in model.q_norm.parameters():
            dist.all_reduce(p.main_grad, group=tp)
        end = buffer.numel() if reduced_numel == "all" else buffer.numel() - HIDDEN
        bucket = buffer[:end]
        bucket.mul_(1 / dp_size)  # Megatron's gradient_scaling_factor, then a SUM all-reduce
        dist.all_reduce(bucket, group=dp)
        sc.check_gradients(model)
    shards = {"q_proj.weight": 0, "head_scale": 0, "o_proj.weight": 1}
    diffs = {name: max_diff(p.main_grad, shard(full.get_parameter(name).grad, shards[name], tp)
                            if name in shards else full.get_parameter(name).grad)
             for name, p in model.named_parameters()}
    return {"diffs": diffs, "violations": found()}




# ---- 6. a large layout on a fake process group ---------------------------------------------

FAKE_LAYOUT = {"dp": 64, "cp": 4, "tp": 8}  # 2048 ranks, Megatron order (tp fastest)


def fake_layout_groups(rank: int) -> dict[str, dist.ProcessGroup]:
    """tp, cp, dp and the dp x cp gradient group of ``rank``; every group is made, as on real ranks."""
    dp_size, cp_size, tp_size = FAKE_LAYOUT.values()
    coords = {"tp": rank % tp_size, "cp": rank // tp_size % cp_size, "dp": rank // (tp_size * cp_size)}

    def rank_of(dp: int, cp: int, tp: int) -> int:
        return tp + tp_size * (cp + cp_size * dp)
    lines = {
        "tp": [[rank_of(d, c, t) for t in range(tp_size)] for d in range(dp_size) for c in range(cp_size)],
        "cp": [[rank_of(d, c, t) for c in range(cp_size)] for d in range(dp_size) for t in range(tp_size)],
        "dp": [[rank_of(d, c, t) for d in range(dp_size)] for c in range(cp_size) for t in range(tp_size)],
        "dp_cp": [[rank_of(d, c, t) for d in range(dp_size) for c in range(cp_size)]
                  for t in range(tp_size)],
    }
    mine = {}
    for name, groups in lines.items():
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = group
    assert coords["tp"] == dist.get_rank(mine["tp"])
    return mine


def fake_layout_step(reduce_over: str) -> list[tuple[str, str | None, str | None]]:
    """One rank of TP=8 x CP=4 x DP=64: a tp MLP on its sequence shard and its own batch.

    The loss is P over cp (a sum over the local sequence shard) and V over dp; the gradients
    are all-reduced over ``reduce_over`` ("dp_cp", Megatron's group, or just "dp").
    """
    groups = fake_layout_groups(dist.get_rank())
    tp = groups["tp"]
    model = SequenceParallelMLP(None, None)
    model.fc1.weight = nn.Parameter(torch.randn(FFN // 8, HIDDEN))
    model.fc2.weight = nn.Parameter(torch.randn(HIDDEN, FFN // 8))
    mesh = sc.Mesh(tp=tp, cp=groups["cp"], dp=groups["dp"])
    with sc.typecheck(mesh, mode="collect"):
        sc.annotate_parameters(model, on("tp", MLP_TYPES), cp=sc.R, dp=sc.R)
        x = sc.annotate(torch.randn(SEQ, HIDDEN), tp=sc.R, cp=sc.S(0), dp=sc.V)
        h = F.gelu(model.fc1(CopyToRegion.apply(model.norm(x), tp)))
        out = ReduceFromRegion.apply(model.fc2(h), tp)
        out.pow(2).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=groups[reduce_over])
        sc.check_gradients(model)
    return found()


def run_cases(cases: dict[str, tuple]) -> dict[str, dict]:
    """Run several programs one after another on the same ranks: {case: fn(*args)}."""
    return {case: fn(*args) for case, (fn, *args) in cases.items()}
