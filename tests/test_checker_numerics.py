"""Property: the checker never changes numerics (bitwise-equal outputs with and without it)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardcheck as sc

MESH = sc.Mesh(rank=1, tp=[0, 1], dp=[1, 3])
N = 4

STEPS = {
    "add": lambda x, o: x + o,
    "sub": lambda x, o: x - o * 0.5,
    "mul": lambda x, o: x * o,
    "div": lambda x, o: x / (o.abs() + 1),
    "add_": lambda x, o: x.clone().add_(o),
    "matmul": lambda x, o: x @ o / N,
    "linear": lambda x, o: F.linear(x, o, o[0]),
    "relu": lambda x, o: F.relu(x),
    "gelu": lambda x, o: F.gelu(x),
    "silu": lambda x, o: F.silu(x),
    "tanh": lambda x, o: torch.tanh(x),
    "exp": lambda x, o: torch.exp(x.clamp(-5, 5)),
    "softmax": lambda x, o: x.softmax(-1),
    "log_softmax": lambda x, o: x.log_softmax(0),
    "layer_norm": lambda x, o: F.layer_norm(x, (N,)),
    "rms_norm": lambda x, o: F.rms_norm(x, (N,), eps=1e-5),
    "sum": lambda x, o: x.sum(0, keepdim=True).expand(N, N),
    "mean": lambda x, o: x.mean(-1, keepdim=True) + x,
    "amax": lambda x, o: x - x.amax(-1, keepdim=True),
    "transpose": lambda x, o: x.t(),
    "view": lambda x, o: x.reshape(N * N).view(N, N),
    "cat_split": lambda x, o: torch.cat([x, o], 1).split(N, 1)[0],
    "chunk": lambda x, o: torch.cat(x.chunk(2, 0)[::-1]),
    "slice": lambda x, o: torch.cat([x[:, 2:], x[:, :2]], 1),
    "masked_fill": lambda x, o: x.masked_fill(o > 0, 0.0),
    "where": lambda x, o: torch.where(o > 0, x, o),
    "zeros_acc": lambda x, o: torch.zeros_like(x).add_(x),
    "dropout": lambda x, o: F.dropout(x, 0.0, True),
    "to": lambda x, o: x.double().float(),
}
PLACEMENTS = [sc.R, sc.P, sc.V, sc.S(0), sc.S(1), sc.I]


def _run(steps, seed, typed_as=None):
    gen = torch.Generator().manual_seed(seed)
    x, others = torch.randn(N, N, generator=gen), [torch.randn(N, N, generator=gen)
                                                  for _ in steps]
    if typed_as is not None:
        x = sc.annotate(x, tp=typed_as[0], dp=typed_as[1])
        others = [sc.annotate(o, tp=typed_as[1]) for o in others]
    for name, other in zip(steps, others, strict=True):
        x = STEPS[name](x, other)
    return x


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=10),
       st.integers(0, 2**16), st.sampled_from(PLACEMENTS), st.sampled_from(PLACEMENTS))
def test_checker_never_changes_numerics(steps, seed, tp, dp):
    plain = _run(steps, seed)
    with sc.typecheck(MESH, mode="collect"):
        checked = _run(steps, seed, (tp, dp))
    torch.testing.assert_close(checked, plain, rtol=0, atol=0, equal_nan=True)
