"""A violation the autograd engine raises in a C++ backward node is located at the ``backward``
call, with the node's name; under anomaly mode, which keeps each node's forward traceback, at the
forward line that made the node (the audit reruns a finding's case so to name its root line)."""

import contextlib
import inspect

import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks


def _split_of_a_replicated_value(anomaly: bool, heads_sharded: bool) -> list[dict]:
    """``x`` (R) split in two: one half feeds a replicated term, the other one term per head.
    With the heads cut over tp, that half's gradient is a partial sum over tp, and the split's
    backward ``cat`` joins it to the replicated one."""
    mode = torch.autograd.detect_anomaly(check_nan=False) if anomaly else contextlib.nullcontext()
    rows = 3 if heads_sharded else 6
    with mode, sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):
        x = sc.annotate(torch.ones(4), tp=sc.R).requires_grad_(True)
        a, b = x.split(2)  # the forward line of the backward cat
        heads = sc.annotate(torch.arange(1.0, rows + 1).view(rows, 1), tp=sc.S(0) if heads_sharded else sc.R)
        head_type = sc.S(0) if heads_sharded else sc.R
        torch.autograd.backward([a * 2, b * heads],  # the backward call
                                [sc.annotate(torch.ones(2), tp=sc.R), sc.annotate(torch.ones(rows, 2), tp=head_type)])
        return [v.as_dict() for v in sc.violations()]


def _line_of(text: str) -> str:
    source, start = inspect.getsourcelines(_split_of_a_replicated_value)
    return f"{__file__}:{start + next(n for n, line in enumerate(source) if text in line)}"


def _all_variants() -> dict:
    return {(anomaly, sharded): _split_of_a_replicated_value(anomaly, sharded)
            for anomaly in (False, True) for sharded in (True, False)}


def test_a_backward_violation_is_at_the_backward_call_and_under_anomaly_mode_at_its_forward_line():
    for rank in spawn_ranks(_all_variants, 2):
        plain, anomaly = rank[(False, True)], rank[(True, True)]
        assert [(v["rule"], v["op"], v["backward"]) for v in plain + anomaly] == \
            [("affine on partial", "aten.cat.default", "SplitBackward0")] * 2
        assert plain[0]["partial"] == anomaly[0]["partial"] == [1]  # b's gradient, the cat's operand 1
        assert plain[0]["location"] == _line_of("# the backward call")
        assert anomaly[0]["location"] == _line_of("# the forward line of the backward cat")
        assert _line_of("# the forward line of the backward cat") in anomaly[0]["line"]
        assert rank[(False, False)] == rank[(True, False)] == []  # replicated heads: a replicated gradient
