"""One test per row of the rule tables, on a one-axis mesh seen from rank 0 (no processes)."""

import pytest
import torch
import torch.nn.functional as F

import shardcheck as sc
from shardcheck.typecheck.types import PAVG, PEVEN, BlockShard, SectionShard

MESH = sc.Mesh(rank=0, tp=[0, 1])
R, P, V, S = sc.R, sc.P, sc.V, sc.S


def T(*shape, tp=R):  # noqa: N802 - a typed tensor factory, short on purpose
    return sc.annotate(torch.randn(*shape), tp=tp)


def C(*shape, tp=R):  # noqa: N802 - a constant (all ones) typed tensor
    return sc.annotate(torch.ones(*shape), tp=tp)


def _heads(heads: int = 2):
    """Queries of this rank's heads of batch 2, [s, b, heads, d] merged to [b * heads, s, d]."""
    return T(4, 2, heads, 3, tp=S(2)).reshape(4, 2 * heads, 3).transpose(0, 1)


def _repeated_key(heads: int = 2):
    """One key head every rank holds whole, repeated to the rank's heads: [s, b, heads, d]."""
    return T(4, 2, 1, 3).repeat_interleave(heads, dim=2)


def _grouped_qkv(shape=(4, 2, 32)):
    """Megatron's fused QKV of one query group a rank (2 query heads, 1 key, 1 value, 8 wide)
    viewed by groups, [s, b, g * 32] -> [s, b, g, 32], cut into q, k and v (``shape``: the
    input in another layout of the same elements)."""
    return torch.split(T(*shape, tp=S(2)).view(4, 2, 1, 32), [16, 8, 8], dim=3)


def _grouped_query():
    """The rank's query heads of its one group: [s, b, 1, 16] -> [s, b, 2, 8]."""
    return _grouped_qkv()[0].reshape(4, 2, 2, 8)


def _grouped_key():
    """The key of the rank's one group, repeated to its 2 query heads (DotProductAttention)."""
    return _grouped_qkv()[1].repeat_interleave(2, dim=2)


def own_order():
    """Row indices each rank computed from its own data (an argsort of its routing map): V."""
    return sc.annotate(torch.tensor([2, 0, 3, 1]), tp=V)


def _top_k_scattered(rows):
    """Each row's top 2 values written into zeros of the rows' shape, as topk's backward does."""
    values, index = rows.topk(2, dim=1)
    return torch.zeros(rows.shape).scatter(1, index, values)


def even(n=4):
    """The token count of a sequence shard of an all-ones mask: P(even)."""
    return C(n, tp=S(0)).sum()


def outcome(program, mesh=MESH):
    """The tp placement of the program's result, or the violated rule's name."""
    with sc.typecheck(mesh):
        try:
            return sc.typeof(program()).get("tp")
        except sc.SpmdTypeError as err:
            return err.rule


def _written_whole(grad):
    """A flat zero buffer, a view of all of it shaped like ``grad``, ``grad`` copied into it."""
    buffer = grad.new_zeros(grad.numel())
    buffer.as_strided(grad.shape, grad.stride()).copy_(grad)
    return buffer


ELEMENTWISE = [
    ("R+R", lambda: T(4, 3) + T(4, 3), R),
    ("S+S same dim", lambda: T(4, 3, tp=S(0)) * T(4, 3, tp=S(0)), S(0)),
    ("S+S broadcast", lambda: T(2, 4, 3, tp=S(1)) + T(4, 3, tp=S(0)), S(1)),
    ("S(0)+S(1)", lambda: T(4, 4, tp=S(0)) + T(4, 4, tp=S(1)), "mixed shards"),
    ("R extent 1 + S", lambda: T(1, 3) + T(4, 3, tp=S(0)), S(0)),
    ("R broadcast + S", lambda: T(3) + T(4, 3, tp=S(0)), S(0)),
    ("R full + S", lambda: T(4, 3) + T(4, 3, tp=S(1)), "global shape mismatch"),
    ("R full bias + S(-1)", lambda: T(4, 3, tp=S(-1)) + T(3), "global shape mismatch"),
    ("V*R", lambda: T(4, tp=V) * T(4), V),
    ("V+S", lambda: T(4, tp=V) + T(4, tp=S(0)), V),
]

LINEAR_ON_PARTIAL = [
    ("P+P", lambda: T(4, tp=P) + T(4, tp=P), P),
    ("P-P", lambda: T(4, tp=P) - T(4, tp=P), P),
    ("-P", lambda: -T(4, tp=P), P),
    ("P*const", lambda: T(4, tp=P) * 3.0, P),
    ("P*R", lambda: T(4, tp=P) * T(4), P),
    ("sum P", lambda: T(4, 3, tp=P).sum(0), P),
    ("mean P", lambda: T(4, 3, tp=P).mean(), P),
    ("view P", lambda: T(4, 3, tp=P).view(12), P),
    # as_strided picks the same elements on every rank: linear on a partial sum, and on a
    # replicated value; a shard's meaning is lost (unknown, not a guess)
    ("as_strided P", lambda: T(4, 3, tp=P).as_strided((3, 2), (1, 3)), P),
    ("as_strided R", lambda: T(4, 3).as_strided((2, 2), (3, 1), 1), R),
    ("as_strided S", lambda: T(4, 3, tp=S(0)).as_strided((3, 2), (1, 3)), None),
    ("as_strided P then exp", lambda: T(4, 3, tp=P).as_strided((3, 2), (1, 3)).exp(), "non-linear on partial"),
    # one that reads all of a contiguous input in order is a reshape
    ("as_strided reshape S", lambda: T(4, 3, tp=S(0)).as_strided((12,), (1,)), S(0)),
    ("as_strided reshape S + R", lambda: T(4, 3, tp=S(0)).as_strided((12,), (1,)) + T(12),
     "global shape mismatch"),
    # autograd's view backward: zeros, a view of all of them, the gradient copied in
    ("zeros written whole", lambda: _written_whole(T(4, 6, tp=S(0))), S(0)),
    ("zeros written whole + R", lambda: _written_whole(T(4, 6, tp=S(0))) + T(24), "global shape mismatch"),
    ("permute P", lambda: T(4, 3, 2, tp=P).permute(2, 0, 1), P),
    ("transpose P", lambda: T(4, 3, tp=P).transpose(0, 1), P),
    ("cat P", lambda: torch.cat([T(4, tp=P), T(4, tp=P)]), P),
    ("stack P", lambda: torch.stack([T(4, tp=P), T(4, tp=P)]), P),
    ("P+R", lambda: T(4, tp=P) + T(4), "affine on partial"),
    ("P+const", lambda: T(4, tp=P) + 1.0, "affine on partial"),
    ("P+0", lambda: T(4, tp=P) + 0, P),
    ("P+S", lambda: T(4, tp=P) + T(4, tp=S(0)), "affine on partial"),
    ("P*P", lambda: T(4, tp=P) * T(4, tp=P), "partial product"),
    ("P@P", lambda: T(4, 3, tp=P) @ T(3, 2, tp=P), "partial product"),
    ("R/P", lambda: T(4) / T(4, tp=P), "division by partial"),
    ("P/P", lambda: T(4, tp=P) / T(4, tp=P), "division by partial"),
    ("P/R", lambda: T(4, tp=P) / T(4), P),
    ("P/const", lambda: T(4, tp=P) / 2, P),
    ("P masked_fill 0", lambda: T(4, tp=P).masked_fill(T(4) > 0, 0.0), P),
    ("P masked_fill 1", lambda: T(4, tp=P).masked_fill(T(4) > 0, 1.0), "affine on partial"),
    ("where(R, P, 0)", lambda: torch.where(T(4) > 0, T(4, tp=P), 0.0), P),
]

EVEN_PARTIAL = [
    ("sum of constant shard", even, PEVEN),
    ("sum of shard", lambda: T(4, tp=S(0)).sum(), P),
    ("P / P(even)", lambda: T(4, tp=S(0)).sum() / even(), PAVG),
    ("P / clamp P(even)", lambda: T(4, tp=S(0)).sum() / torch.clamp(even(), min=1), PAVG),
    ("P(even) / P(even)", lambda: (2 * even()) / even(), R),
    ("R / P(even)", lambda: T(()) / even(), "division by partial"),
    ("S / P(even)", lambda: T(4, tp=S(0)) / even(), "division by partial"),
    ("P(avg) / P(even)", lambda: T(4, 3, tp=S(1)).mean(-1) / even(), "mean over shard"),
    ("P / P", lambda: T(4, tp=S(0)).sum() / T(4, tp=S(0)).sum(), "division by partial"),
    ("clamp P(even)", lambda: torch.clamp(even(), min=1), PEVEN),
    ("relu P(even)", lambda: F.relu(even()), PEVEN),
    ("abs P(even)", lambda: even().abs(), PEVEN),
    ("clamp P", lambda: torch.clamp(T(4, tp=P), min=1), "non-linear on partial"),
    ("exp P(even)", lambda: even().exp(), "non-linear on partial"),
    ("P + P(even)", lambda: T((), tp=P) + even(), P),
    ("P(even) * R", lambda: even() * T(()), PEVEN),
    ("P(even) + R", lambda: even() + T(()), "affine on partial"),
    ("select of a constant", lambda: C(2, 3)[0], R),  # rank 0's index: no chunk of a constant
    ("index_select of a constant stays constant",
     lambda: C(4, 2).index_select(0, torch.tensor([0, 3]))[0].sum(), R),
]

PIECES = [
    ("split piece alone", lambda: torch.split(T(4, 3), 2)[0] * 2, S(0)),
    ("split piece with R", lambda: torch.split(T(4, 3), 2)[0].log() - T(2, 3), R),
    ("chunk piece with a shard", lambda: T(4, 3).chunk(2)[0] + T(2, 3, tp=S(1)),
     "global shape mismatch"),
    ("unsqueezed piece with a shard", lambda: T(2, 3, tp=S(1)) / T(4).chunk(2)[0].unsqueeze(-1), S(1)),
    ("constant shard times R", lambda: C(4, 3, tp=S(0)) * T(4, 3), R),
    ("cat with a constant", lambda: torch.cat([T(2, 3, tp=S(0)), C(2, 1).expand(2, 1)], 1), S(0)),
    ("cat with a full R", lambda: torch.cat([T(2, 3, tp=S(0)), T(2, 1)], 1), "global shape mismatch"),
    # the off-by-one softmax sink: one R value per head expanded along the sharded query dim
    ("cat with an R row expanded along the shard dim",
     lambda: torch.cat([T(2, 4, 3, tp=S(1)), T(2, 1, 1).expand(-1, 4, -1)], -1), S(1)),
    ("cat with an R row repeated along the shard dim (a copy, still one value along it)",
     lambda: torch.cat([T(2, 4, 3, tp=S(1)), T(2, 1, 1).expand(-1, 4, -1) * 2], -1), S(1)),
    ("cat with a full R along the shard dim", lambda: torch.cat([T(2, 4, 3, tp=S(1)), T(2, 4, 1)], -1),
     "global shape mismatch"),
]

NONLINEAR = {
    "exp": torch.exp, "log": torch.log, "softmax": lambda x: x.softmax(-1),
    "log_softmax": lambda x: x.log_softmax(-1), "gelu": F.gelu, "silu": F.silu,
    "relu": F.relu, "pow": lambda x: x**2, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "norm": torch.linalg.vector_norm, "max": torch.max, "amax": lambda x: x.amax(-1),
    "min": lambda x: x.min(-1).values, "gt": lambda x: x > 0, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "erf": torch.erf, "abs": torch.abs,
    "layer_norm": lambda x: F.layer_norm(x, (3,)), "rms_norm": lambda x: F.rms_norm(x, (3,)),
    "cross_entropy": lambda x: F.cross_entropy(x, torch.tensor([0, 1, 2, 0])),
}

REDUCTIONS = [
    ("sum over S", lambda: T(4, 3, tp=S(0)).sum(0), P),
    ("sum all of S", lambda: T(4, 3, tp=S(1)).sum(), P),
    ("sum over other dim", lambda: T(4, 3, tp=S(0)).sum(1), S(0)),
    ("sum keepdim", lambda: T(4, 3, tp=S(1)).sum(0, keepdim=True), S(1)),
    ("mean over S", lambda: T(4, 3, tp=S(1)).mean(-1), PAVG),
    ("mean over S then use", lambda: T(4, 3, tp=S(1)).mean(-1) + T(4), "mean over shard"),
    ("mean over other dim", lambda: T(4, 3, tp=S(1)).mean(0), S(0)),
    ("max over S", lambda: T(4, 3, tp=S(1)).amax(-1), V),
    ("argmax over S", lambda: T(4, 3, tp=S(1)).argmax(-1), V),
    ("min over S", lambda: T(4, 3, tp=S(1)).min(-1).values, V),
    ("softmax over S", lambda: T(4, 3, tp=S(1)).softmax(-1), "normalization over shard"),
    ("softmax over other", lambda: T(4, 3, tp=S(1)).softmax(0), S(1)),
    ("log_softmax over S", lambda: T(4, 3, tp=S(1)).log_softmax(1), "normalization over shard"),
    ("layer_norm over S", lambda: F.layer_norm(T(4, 3, tp=S(1)), (3,)), "normalization over shard"),
    ("layer_norm seq-sharded", lambda: F.layer_norm(T(4, 3, tp=S(0)), (3,), T(3), T(3)), S(0)),
    ("norm over S", lambda: torch.linalg.vector_norm(T(4, 3, tp=S(1)), dim=1),
     "normalization over shard"),
    ("cross_entropy over vocab shard",
     lambda: F.cross_entropy(T(4, 3, tp=S(1)), torch.tensor([0, 1, 2, 0])),
     "normalization over shard"),
    ("nll sum of seq shard", lambda: F.nll_loss(T(4, 3, tp=S(0)), T(4, tp=S(0)).long().abs() % 3,
                                                reduction="sum"), P),
]

MATMUL = [
    ("contract S,S", lambda: T(4, 6, tp=S(1)) @ T(6, 2, tp=S(0)), P),
    ("contract S,R", lambda: T(4, 6, tp=S(1)) @ T(6, 2), "global shape mismatch"),
    ("contract R,S", lambda: T(4, 6) @ T(6, 2, tp=S(0)), "global shape mismatch"),
    ("linear R x S(0) weight", lambda: F.linear(T(4, 8), T(6, 8, tp=S(0))), S(1)),
    ("linear 3d R x S(0) weight", lambda: F.linear(T(2, 4, 8), T(6, 8, tp=S(0)), T(6, tp=S(0))),
     S(2)),
    ("linear S(-1) x S(1) weight", lambda: F.linear(T(2, 4, 3, tp=S(2)), T(8, 3, tp=S(1))), P),
    ("linear bias on partial", lambda: F.linear(T(4, 3, tp=S(1)), T(8, 3, tp=S(1)), T(8)),
     "affine on partial"),
    ("P @ R", lambda: T(4, 6, tp=P) @ T(6, 2), P),
    ("R @ P", lambda: T(4, 6) @ T(6, 2, tp=P), P),
    ("batch-sharded bmm", lambda: torch.bmm(T(4, 2, 3, tp=S(0)), T(4, 3, 5, tp=S(0))), S(0)),
    ("bmm contraction", lambda: torch.bmm(T(4, 2, 3, tp=S(2)), T(4, 3, 5, tp=S(1))), P),
    ("baddbmm", lambda: torch.baddbmm(T(4, 2, 5, tp=S(0)), T(4, 2, 3, tp=S(0)),
                                      T(4, 3, 5, tp=S(0))), S(0)),
    ("einsum", lambda: torch.einsum("bhd,bkd->bhk", T(2, 4, 3, tp=S(1)), T(2, 5, 3)), S(1)),
    ("matmul S(0)xR", lambda: T(4, 6, tp=S(0)) @ T(6, 2), S(0)),
    ("matmul S(0)xS(1)", lambda: T(4, 6, tp=S(0)) @ T(6, 2, tp=S(1)), "mixed shards"),
    # a rank-chunk guess (rank 0's chunk of a split) that does not line up is the R it is
    ("chunk piece x column shard", lambda: T(4, 6).chunk(2)[0] @ T(6, 2, tp=S(1)), S(1)),
    ("viewed chunk piece x column shard",
     lambda: F.linear(T(4, 2, 6).chunk(2)[0], T(2, 6, tp=S(0))), S(2)),
    ("chunk piece x full R", lambda: T(6, 4).chunk(2)[0] @ T(4, 2), S(0)),
    # one key head repeated to the heads, merged after the batch: one value per batch block
    ("repeated key fits the heads' block shard",
     lambda: torch.bmm(_heads(), _repeated_key().view(4, 2 * 2, 3).transpose(0, 1).transpose(1, 2)),
     BlockShard(0, 2)),
    # merged heads-outer, it repeats every 2 rows: 3 heads a rank are no whole repeats (2 would
    # be, and would give on two ranks what one computes)
    ("key merged heads-outer is no broadcast in the batch blocks",
     lambda: torch.bmm(_heads(3), _repeated_key(3).transpose(1, 2).reshape(4, 2 * 3, 3)
                       .transpose(0, 1).transpose(1, 2)), "global shape mismatch"),
    ("full R key does not fit the heads' shard",
     lambda: torch.bmm(_heads(), T(4, 4, 3).transpose(0, 1).transpose(1, 2)), "global shape mismatch"),
]

SHAPES = [
    ("view split sharded dim", lambda: T(6, 4, tp=S(0)).view(2, 3, 4), S(0)),
    ("view split last", lambda: T(2, 3, 8, tp=S(2)).view(2, 3, 2, 4), S(2)),
    ("view merge outer sharded", lambda: T(2, 3, 4, tp=S(0)).reshape(6, 4), S(0)),
    ("view merge heads", lambda: T(5, 2, 3, 4, tp=S(2)).reshape(5, 2, 12), S(2)),
    ("view merge inner shard: blocks", lambda: T(2, 3, 4, tp=S(1)).reshape(6, 4),
     BlockShard(0, 2)),
    ("view merge inner shard, rows cut", lambda: T(2, 3, 4, tp=S(2)).reshape(2, 12),
     BlockShard(1, 3)),
    ("view blocks back", lambda: T(2, 3, 4, tp=S(1)).reshape(6, 4).view(2, 3, 4), S(1)),
    ("view cuts through pieces", lambda: T(2, 3, tp=S(1)).reshape(3, 2), None),
    ("blocks + S same dim", lambda: T(2, 3, 4, tp=S(1)).reshape(6, 4) + T(6, 4, tp=S(0)),
     "mixed shards"),
    ("blocks bmm", lambda: torch.bmm(T(2, 3, 4, 5, tp=S(1)).view(6, 4, 5),
                                     T(2, 3, 5, 2, tp=S(1)).view(6, 5, 2)).view(2, 3, 4, 2), S(1)),
    # a view putting a dim of one before a shard's dim reads two ways: an inserted dim (the
    # shard stays on its data) or one group a rank (the shard on the dim of one); a cut of the
    # data takes the second, as Megatron's QKV viewed by query groups means it
    ("view inserting dims of one", lambda: T(2, tp=S(0)).view(1, 2, 1, 1), S(1)),
    ("view inserting dims of one + S", lambda: T(2, tp=S(0)).view(1, 2, 1, 1) + T(3, 2, 4, 4, tp=S(1)),
     S(1)),
    ("view by groups, one a rank, cut", lambda: _grouped_qkv()[2], S(2)),
    ("view by groups, one a rank, select", lambda: T(4, 2, 32, tp=S(2)).view(4, 2, 1, 32)[..., 0], S(2)),
    ("grouped query heads", _grouped_query, S(2)),
    ("grouped key repeated to the heads", _grouped_key, S(2)),
    ("grouped query x key", lambda: _grouped_query() * _grouped_key(), S(2)),
    ("grouped attention scores", lambda: torch.einsum("sbhd,tbhd->bhst", _grouped_query(), _grouped_key()),
     S(1)),
    ("grouped key tiled, not interleaved", lambda: _grouped_query() * _grouped_qkv()[1].repeat(1, 1, 2, 1), V),
    ("grouped query x every group's key", lambda: _grouped_query() * T(4, 2, 2, 8), "global shape mismatch"),
    ("cut after an annotated dim of one", lambda: torch.split(T(4, 2, 1, 32, tp=S(3)), [16, 8, 8], 3)[0], V),
    ("cut after a view that kept a dim of one", lambda: _grouped_qkv((8, 1, 32))[0], V),
    ("flatten", lambda: T(2, 3, 4, tp=S(0)).flatten(), S(0)),
    ("permute", lambda: T(2, 3, 4, tp=S(0)).permute(2, 0, 1), S(1)),
    ("transpose", lambda: T(2, 3, 4, tp=S(2)).transpose(0, 2), S(0)),
    ("t", lambda: T(2, 3, tp=S(0)).t(), S(1)),
    ("unsqueeze", lambda: T(2, 3, tp=S(1)).unsqueeze(0), S(2)),
    ("squeeze", lambda: T(1, 2, 3, tp=S(2)).squeeze(0), S(1)),
    ("expand", lambda: T(2, 3, tp=S(1)).expand(4, 2, 3), S(2)),
    ("narrow unsharded", lambda: T(4, 6, tp=S(1)).narrow(0, 1, 2), S(1)),
    ("slice unsharded", lambda: T(4, 6, tp=S(1))[1:3], S(1)),
    ("slice sharded", lambda: T(4, 6, tp=S(1))[:, 1:3], V),
    ("index unsharded", lambda: T(4, 6, tp=S(1))[2], S(0)),
    ("index sharded", lambda: T(4, 6, tp=S(0))[2], V),
    ("split unsharded", lambda: torch.split(T(4, 6, tp=S(1)), 2, 0)[1], S(1)),
    ("chunk sharded", lambda: torch.chunk(T(4, 6, tp=S(1)), 3, 1)[1], V),
    ("chunk of P", lambda: torch.chunk(T(4, 6, tp=P), 2, 1)[1], P),
    ("cat along other dim", lambda: torch.cat([T(4, 3, tp=S(0)), T(4, 3, tp=S(0))], 1), S(0)),
    ("cat along sharded dim: sections", lambda: torch.cat([T(4, 3, tp=S(0)), T(2, 3, tp=S(0))], 0),
     SectionShard(0, (4, 2))),
    ("cat of a shard and a varying piece", lambda: torch.cat([T(4, 3, tp=S(0)), T(4, 3, tp=V)], 0), V),
    ("stack", lambda: torch.stack([T(4, 3, tp=S(1)), T(4, 3, tp=S(1))]), S(2)),
    ("index along sharded dim", lambda: T(4, 6, tp=S(1))[torch.arange(4), torch.arange(4)], V),
    ("index before shard", lambda: T(4, 6, tp=S(1))[torch.tensor([0, 2])], S(1)),
    ("index of R", lambda: T(4, 6)[torch.tensor([0, 2])], R),
    ("row lookup in a row-sharded table: embedding", lambda: T(4, 6, tp=S(0))[
        torch.tensor([[0, 2]])], P),
    ("row lookup agrees with embedding", lambda: F.embedding(torch.tensor([[0, 2]]),
                                                            T(4, 6, tp=S(0))), P),
    ("row lookup by varying indices", lambda: T(4, 6, tp=S(0))[
        sc.annotate(torch.tensor([0, 2]), tp=V)], V),
    ("row lookup by sharded indices", lambda: T(4, 6, tp=S(0))[
        sc.annotate(torch.tensor([0, 2]), tp=S(0))], V),
    ("index_put into shard", lambda: T(4, 6, tp=S(1)).index_put_(
        (torch.arange(2),), T(2, 6, tp=V)), S(1)),
    ("index_put into V", lambda: T(4, tp=V).index_put_((torch.arange(2),), torch.tensor(0.0)),
     V),
    ("index_put zero into P", lambda: T(4, tp=P).index_put_((torch.arange(2),),
                                                            torch.tensor(0.0)), P),
    ("baddbmm beta=0 ignores its buffer", lambda: torch.baddbmm(
        torch.empty(4, 2, 5), T(4, 2, 3, tp=S(0)), T(4, 3, 5, tp=S(0)), beta=0.0), S(0)),
    ("contiguous/clone/detach", lambda: T(4, 3, tp=S(1)).t().contiguous().clone().detach(), S(0)),
    ("type conversion", lambda: T(4, 3, tp=P).to(torch.float64).half(), P),
    ("pad unsharded dim", lambda: F.pad(T(2, 4, 3, tp=S(1)), (0, 5)), S(1)),
    ("pad sharded dim", lambda: F.pad(T(2, 4, 3, tp=S(1)), (0, 0, 1, 0)), V),
    ("pad P with zeros", lambda: F.pad(T(4, 3, tp=P), (0, 2)), P),
    ("pad P with ones", lambda: F.pad(T(4, 3, tp=P), (0, 2), value=1.0), V),
    ("pad R", lambda: F.pad(T(4, 3), (2, 2), value=1.0), R),
    ("gather unsharded dim", lambda: torch.gather(T(4, 3, tp=S(0)), 1,
                                                  sc.annotate(torch.zeros(4, 1).long(), tp=S(0))),
     S(0)),
    # topk's backward under a rank-sliced batch (the router's tokens, a rank's chunk of them)
    ("scatter into zeros of a rank chunk's top-k", lambda: _top_k_scattered(T(8, 3).chunk(2)[0]), S(0)),
    # MoE's unpermute: each rank adds its own (permuted) rows back by its own index
    ("index_add of a row shard by each rank's own index", lambda: torch.zeros(4, 3).index_add_(
        0, own_order(), T(4, 3, tp=S(0))), S(0)),
    ("scatter_add of a row shard by each rank's own index", lambda: torch.zeros(4, 3).scatter_add_(
        0, own_order().unsqueeze(1).expand(-1, 3), T(4, 3, tp=S(0))), S(0)),
    ("index_add of a row shard by a replicated index", lambda: torch.zeros(4, 3).index_add_(
        0, sc.annotate(torch.tensor([2, 0, 3, 1]), tp=R), T(4, 3, tp=S(0))), V),
    ("index_add of replicated rows by each rank's own index", lambda: torch.zeros(4, 3).index_add_(
        0, own_order(), T(4, 3)), V),
    ("index_add of a column shard by each rank's own index", lambda: torch.zeros(4, 3).index_add_(
        0, own_order(), T(4, 3, tp=S(1))), V),
]

FACTORIES = [
    ("zeros", lambda: torch.zeros(3), R), ("ones", lambda: torch.ones(3), R),
    ("arange", lambda: torch.arange(3), R), ("full", lambda: torch.full((3,), 2.0), R),
    ("empty", lambda: torch.empty(3), R), ("eye", lambda: torch.eye(3), R),
    ("tensor", lambda: torch.tensor([1.0, 2.0]), R),
    ("zeros_like of P", lambda: torch.zeros_like(T(3, tp=P)), R),
    ("empty_like of a shard", lambda: torch.empty_like(T(3, tp=S(0))), S(0)),
    ("dropout of a shard", lambda: F.dropout(T(4, 3, tp=S(1)), 0.5, True), S(1)),
    ("randn", lambda: torch.randn(3), V), ("rand", lambda: torch.rand(3), V),
    ("randint", lambda: torch.randint(0, 5, (3,)), V),
]

ROWS = (ELEMENTWISE + LINEAR_ON_PARTIAL + EVEN_PARTIAL + PIECES + REDUCTIONS + MATMUL + SHAPES
        + FACTORIES)


@pytest.mark.parametrize(("program", "expected"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_rule_row(program, expected):
    assert outcome(program) == expected


ON_A_ROW_SHARD = {  # what each op of NONLINEAR gives on S(0) rows; elementwise and per-row: S(0)
    "cross_entropy": PAVG,  # the mean over the batch, whose rows are cut
    "max": V,  # over every dim, the cut one too: each rank its own shard's maximum
    "norm": "normalization over shard",
}


@pytest.mark.parametrize("name", sorted(NONLINEAR))
def test_nonlinear_on_partial_and_on_a_shard(name):
    op = NONLINEAR[name]
    assert outcome(lambda: op(T(4, 3, tp=P))) == "non-linear on partial"
    assert outcome(lambda: op(T(4, 3, tp=S(0)))) == ON_A_ROW_SHARD.get(name, S(0))


def test_backward_through_a_division_by_an_even_count_is_replicated():
    with sc.typecheck(MESH):
        x = T(4, tp=S(0)).requires_grad_()
        loss = x.sum() / torch.clamp(even(), min=1)
        loss.backward()
        # the division's gradient is R; the sum's backward lays it out as x's rows (a constant)
        assert sc.typeof(loss) == {"tp": PAVG} and sc.typeof(x.grad) == {"tp": S(0)}
    assert outcome(lambda: torch.ones(()) / even()) == "division by partial"  # forward: n x too big


def test_unknown_operand_gives_unknown_not_violation():
    with sc.typecheck(MESH):
        x = T(4, tp=P)
        y = x + torch.randn(4) * 0 + torch.ones(4)  # randn is V, ones is R: V + R = V
        z = x + sc.annotate(torch.randn(4), tp=R)._neg_view()  # no rule: unknown
        assert sc.typeof(y) == {"tp": V} and sc.typeof(z) == {}
    cov = sc.coverage()
    assert cov.unknown >= 1 and any("_neg_view" in name for name, _ in cov.top_unknown)


def test_known_zero_buffer_accumulates_partial():
    with sc.typecheck(MESH):
        buf = torch.zeros(4)
        buf += T(4, tp=P)
        assert sc.typeof(buf) == {"tp": P}
        grad = torch.ones(4).zero_()
        grad.add_(T(4, tp=P))
        assert sc.typeof(grad) == {"tp": P}
        filled = torch.ones(4)
        with pytest.raises(sc.SpmdTypeError) as info:
            filled += T(4, tp=P)
        assert info.value.rule == "affine on partial"


def test_grouped_attention_of_one_group_a_rank_types_its_gradient():
    """The fused QKV's gradient, back through the cut, the key's repeat and the group view, is
    its shard (the column-parallel weight's gradient follows)."""
    with sc.typecheck(MESH):
        qkv = sc.annotate(torch.randn(4, 2, 32, requires_grad=True), tp=S(2))
        query, key, value = torch.split(qkv.view(4, 2, 1, 32), [16, 8, 8], dim=3)
        scores = query.reshape(4, 2, 2, 8) * key.repeat_interleave(2, dim=2)
        (scores.sum() + value.sum()).backward()
        assert sc.typeof(qkv.grad) == {"tp": S(2)}


def test_inplace_op_updates_views_of_the_same_storage():
    with sc.typecheck(MESH):
        flat = torch.zeros(8)
        first, second = flat[:4].view(2, 2), flat[4:].view(2, 2)
        first.copy_(T(2, 2, tp=P))
        assert sc.typeof(first) == {"tp": P} and sc.typeof(second) == {"tp": R}
        assert sc.typeof(flat) == {"tp": P}  # zeros elsewhere: the whole buffer is a partial sum


def test_rank_slice_heuristic_and_typed_helper():
    mesh = sc.Mesh(rank=1, tp=[0, 1])
    with sc.typecheck(mesh):
        x = T(4, 6)
        assert sc.typeof(x[:, 3:6]) == {"tp": S(1)}            # this rank's chunk
        assert sc.typeof(x[:, 0:3]) == {"tp": R}               # another rank's chunk, on every rank
        assert sc.typeof(torch.split(x, 2, 0)[1]) == {"tp": S(0)}
        assert sc.typeof(torch.chunk(x, 2, 1)[1]) == {"tp": S(1)}
        assert sc.typeof(sc.rank_slice(x, "tp", 0)) == {"tp": S(0)}
        uneven = T(7, 2)
        assert sc.typeof(uneven.tensor_split(2)[1]) == {"tp": S(0)}  # rows 4..6 of 7
        assert sc.typeof(uneven[3:6]) == {"tp": R}  # floor-sized pieces drop the tail: no rank's chunk
        assert torch.equal(sc.rank_slice(x, "tp", 1), x[:, 3:])
        with pytest.raises(sc.SpmdTypeError) as info:
            T(4, 6, tp=V)[2:4]
        assert info.value.rule == "split of varying"
        with pytest.raises(sc.SpmdTypeError) as info:
            sc.rank_slice(T(4, 6, tp=V), "tp", 0)
        assert info.value.rule == "split of varying"


def test_a_chunk_several_axes_choose_alike_is_the_named_axis_chunk():
    """Rank 0 of tp [0, 1] and ep [0, 2] has index 0 on both: which one chose the chunk is
    unknown, unless the code says (Megatron's local experts, by the ep rank)."""
    from shardcheck.typecheck.rules.shape import rank_chunks_by

    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1], ep=[0, 2])):
        routing = sc.annotate(torch.rand(8, 4), tp=R, ep=R)
        assert sc.typeof(routing[:, 0:2]) == {}
        with rank_chunks_by("ep"):
            assert sc.typeof(routing[:, 0:2]) == {"tp": R, "ep": S(1)}
            assert sc.typeof(routing[:, 2:4]) == {"tp": R, "ep": R}  # another rank's chunk
        with rank_chunks_by("dp"):  # no such axis here: no answer
            assert sc.typeof(routing[:, 0:2]) == {}


def test_the_whole_of_a_dim_is_no_ranks_chunk():
    """x[:, 0] of a dim of size 1 on rank 0 is tp rank 0's 'chunk' of 1 in 2 only by accident."""
    with sc.typecheck(MESH):
        assert sc.typeof(T(4, 1, 3)[:, 0]) == {"tp": R}
        assert sc.typeof(T(4, 1, 3, tp=V)[:, 0:1]) == {"tp": V}  # no split of varying either
        assert sc.typeof(T(4, 2, 3)[:, 0:1]) == {"tp": S(1)}  # still this rank's chunk of 2


def test_a_fused_dim_cut_at_its_sections_gives_shards():
    """Megatron's fused column-parallel output: each rank holds its piece of q, k and v."""
    fused = SectionShard(1, (2, 2, 4))
    with sc.typecheck(MESH):
        q, k, v = torch.split(T(3, 8, tp=fused), [2, 2, 4], dim=1)
        assert sc.typeof(q) == sc.typeof(v) == {"tp": S(1)}
        qk, _ = torch.split(T(3, 8, tp=fused), [4, 4], dim=1)
        assert sc.typeof(qk) == {"tp": SectionShard(1, (2, 2))}
        assert sc.typeof(torch.split(T(3, 8, tp=fused), [3, 5], dim=1)[0]) == {"tp": V}
        assert sc.typeof(T(3, 8, tp=fused).t()) == {"tp": SectionShard(0, (2, 2, 4))}
        assert sc.typeof(T(3, 8, tp=fused) * T(3, 8, tp=fused)) == {"tp": fused}
        with pytest.raises(sc.SpmdTypeError, match="mixed shards.*sections"):
            T(3, 8, tp=fused) * T(3, 8, tp=S(1))  # its pieces of q, k, v vs one slice
        with pytest.raises(sc.SpmdTypeError, match="mixed shards.*sections"):
            T(3, 8, tp=fused) + T(3, 8, tp=SectionShard(1, (4, 4)))
        assert sc.typeof(T(3, 8, tp=fused).view(3, 2, 4)) == {}  # the fused dim is cut: unknown
        assert sc.typeof(T(3, 8, tp=fused).view(3, 1, 8)) == {"tp": SectionShard(2, (2, 2, 4))}


def test_cat_along_the_cut_dim_joins_sections_that_a_later_cut_takes_apart():
    """GLU's backward: the gradients of its two halves (each cut over tp) joined by cat are the
    fused dim of fc1's output, in sections; cut again at those boundaries they are shards."""
    fused = SectionShard(1, (2, 2, 4))
    with sc.typecheck(MESH):
        joined = torch.cat([T(3, 4, tp=S(1)), T(3, 4, tp=S(1))], dim=-1)
        assert sc.typeof(joined) == {"tp": SectionShard(1, (4, 4))}
        assert sc.typeof(torch.chunk(joined, 2, dim=1)[1]) == {"tp": S(1)}
        nested = torch.cat([T(3, 4, tp=SectionShard(1, (2, 2))), T(3, 4, tp=S(1))], dim=1)
        assert sc.typeof(nested) == {"tp": fused}
        assert sc.typeof(nested * T(3, 8, tp=fused)) == {"tp": fused}
        assert sc.typeof(torch.cat([T(3, 4, tp=S(1)), T(3, 4, tp=S(1))], dim=0)) == {"tp": S(1)}
    # the halves joined in the wrong sections, or a piece that is no shard, still break
    assert outcome(lambda: torch.cat([T(3, 4, tp=S(1)), T(3, 4, tp=S(1))], 1) * T(3, 8, tp=fused)) \
        == "mixed shards"
    assert outcome(lambda: torch.cat([T(3, 4, tp=S(1)), T(3, 4)], 1)) == "global shape mismatch"


def _conv_of_fused_projection(weight_tp, cut=(8, 4, 1, 1), projection_tp=None):
    """GatedDeltaNet's path to its conv: a fused column-parallel output [b, q k v z beta alpha,
    s] cut by torch.split into qkv, z, beta, alpha, then the depthwise causal conv of qkv."""
    from shardcheck.megatron.cpu.kernels import causal_conv1d_fn

    fused = SectionShard(1, (2, 2, 4, 4, 1, 1))
    projection = T(2, 14, 5, tp=fused if projection_tp is None else projection_tp)
    qkv = torch.split(projection, list(cut), dim=1)[0]
    return causal_conv1d_fn(qkv, T(qkv.shape[1], 4, tp=weight_tp), activation="silu")


def test_a_sectioned_conv_weight_fits_its_input_cut_from_the_fused_projection():
    conv_weight = SectionShard(0, (2, 2, 4))  # the conv's channels are q, k, v too
    with sc.typecheck(MESH):
        assert sc.typeof(_conv_of_fused_projection(conv_weight)) == {"tp": SectionShard(1, (2, 2, 4))}
    assert outcome(lambda: _conv_of_fused_projection(SectionShard(0, (4, 2, 2)))) == "mixed shards"
    assert outcome(lambda: _conv_of_fused_projection(S(0))) == "mixed shards"  # one slice
    assert outcome(lambda: _conv_of_fused_projection(conv_weight, projection_tp=R)) == \
        "global shape mismatch"  # an input the checker took for replicated: the old false alarm
    with sc.typecheck(MESH):  # cut off the sections' boundaries: pieces of no global tensor
        assert sc.typeof(_conv_of_fused_projection(S(0), cut=(6, 6, 1, 1))) == {"tp": V}


def test_item_and_tolist_are_typed_reads():
    with sc.typecheck(MESH):
        x = T(3, tp=P)
        assert isinstance(x.sum().item(), float) and len(x.tolist()) == 3
    assert sc.coverage().unknown == 0


def test_constant_seed_with_an_unannotated_axis_fits_a_sharded_contraction():
    # The backward seed (ones) is constant: it fits the batch-sharded input even where an
    # axis is left unannotated, so the weight gradient is a partial sum, not a false alarm.
    mesh = sc.Mesh(rank=0, tp=[0, 1], dp=[0, 2])
    w0, x0 = torch.randn(6, 8, requires_grad=True), torch.randn(4, 8)
    with sc.typecheck(mesh):
        w, x = sc.annotate(w0, tp=R), sc.annotate(x0, tp=S(0))
        torch.nn.functional.linear(x, w).sum().backward()
        assert sc.typeof(w.grad) == {"tp": P}
