"""Routed rows padded with constant rows (a quantized expert's tokens padded to a multiple of
its block, as megatron-core's SequentialMLP does for FP8/FP4: ``torch.cat`` with zeros, the
expert, the output cut back to the rows), types only, on one process.

Each rank holds one local expert's rows, routed to it from both ranks (``Routed``; complete,
so the expert weights' gradients are the expert's whole value, S(0) on ep, as declared).
Padded with zeros and cut back, the padding adds nothing to any sum over the rows: the
gradients stay S(0) and equal the unpadded ones. Padded with other rows (ones, a copy of a
token) whose outputs stay in the loss, the padding rows are summed into the weights'
gradients and the loss: both are no longer the expert's, and the checker says so.
"""

import pytest
import torch
import torch.nn.functional as F

import shardcheck as sc
from shardcheck.typecheck.types import Route, Routed, joined

ROWS, HIDDEN, FFN, BLOCK = 5, 4, 6, 8
UNREDUCED = "unreduced gradient"


def _rows() -> Routed:
    """Rank 0's view: 3 rows of its expert from itself, 2 from rank 1."""
    route = Route(table=((3,), (2,)), sent=(3, 4), grouping=("rows",))
    return Routed(0, route, route.received, sc.V)


def _values(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, HIDDEN, generator=g, dtype=torch.float64),
            torch.rand(ROWS, generator=g, dtype=torch.float64),
            torch.randn(FFN, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(HIDDEN, FFN, generator=g, dtype=torch.float64))


def _expert(tokens, probs, fc1, fc2, variant: str) -> torch.Tensor:
    """The padded expert: ``zeros`` as Megatron pads and cuts back; ``ones`` pads with rows of
    ones and ``repeat`` with copies of the last token, both keeping the padding rows' outputs."""
    pad = BLOCK - tokens.shape[0]
    if variant == "zeros":
        rows = torch.zeros(pad, tokens.shape[1], dtype=tokens.dtype)
    elif variant == "ones":
        rows = torch.ones(pad, tokens.shape[1], dtype=tokens.dtype)
    else:
        rows = tokens[-1:].expand(pad, -1)
    hidden = torch.cat((tokens, rows))
    padded_probs = torch.cat((probs, torch.zeros(pad, dtype=probs.dtype) if variant == "zeros"
                              else torch.ones(pad, dtype=probs.dtype)))
    out = F.linear(F.gelu(F.linear(hidden, fc1)) * padded_probs.unsqueeze(-1), fc2)
    return out[:tokens.shape[0]] if variant == "zeros" else out


def _checked(variant: str):
    tokens, probs, fc1, fc2 = _values()
    fc1, fc2 = fc1.requires_grad_(), fc2.requires_grad_()
    with sc.typecheck(sc.Mesh(rank=0, ep=[0, 1]), mode="collect"):
        sc.annotate(tokens, ep=_rows())
        sc.annotate(probs, ep=_rows())
        sc.annotate_parameters({"fc1": fc1, "fc2": fc2}, ep=sc.S(0))
        out = _expert(tokens, probs, fc1, fc2, variant)
        loss = (out * out).sum()
        loss.backward()
        sc.check_gradients({"fc1": fc1, "fc2": fc2})
        types = [sc.typeof(t).get("ep") for t in (out, loss, fc1.grad, fc2.grad)]
        found = sorted({v.rule for v in sc.violations()})
    return types, found, (fc1.grad, fc2.grad)


def _unpadded_gradients():
    tokens, probs, fc1, fc2 = _values()
    fc1, fc2 = fc1.requires_grad_(), fc2.requires_grad_()
    out = F.linear(F.gelu(F.linear(tokens, fc1)) * probs.unsqueeze(-1), fc2)
    (out * out).sum().backward()
    return fc1.grad, fc2.grad


def test_rows_padded_with_zeros_and_cut_back_keep_the_expert_s_gradients():
    (out, loss, g1, g2), found, grads = _checked("zeros")
    assert out == _rows() and loss == sc.P and (g1, g2) == (sc.S(0), sc.S(0)) and found == []
    assert all(torch.allclose(a, b) for a, b in zip(grads, _unpadded_gradients(), strict=True))


@pytest.mark.parametrize("variant", ["ones", "repeat"])
def test_padding_rows_kept_in_the_loss_are_found(variant):
    (out, loss, g1, g2), found, grads = _checked(variant)
    # rows of ones pad the route; copies of a token are no constant rows: nothing routed
    assert out == (_rows().padded(BLOCK - ROWS, zero=False) if variant == "ones" else sc.V)
    assert loss == sc.V and sc.V in (g1, g2) and UNREDUCED in found, (out, loss, g1, g2, found)
    assert not all(torch.allclose(a, b) for a, b in zip(grads, _unpadded_gradients(), strict=True))


def test_padding_rows_follow_the_parts_only():
    rows = _rows()
    padded = rows.padded(3, zero=True)
    assert padded.piece(0, ROWS) == rows  # the rows cut back
    assert padded.piece(0, ROWS + 3) == padded and padded.piece(0, ROWS + 1) is None
    assert padded.piece(ROWS, 3) is None  # the padding alone is no rows of the route
    assert padded.piece(3, 5).parts == ((1, 0),) and padded.piece(3, 5).pad == 3
    assert joined([rows.piece(0, 3), padded.piece(3, 5)], 0) == padded
    assert joined([padded, rows], 0) is None  # padding between rows
    assert not padded.padded(1, zero=False).zero_pad and padded.lines_up(rows.padded(3, zero=False))
    assert not padded.lines_up(rows)

