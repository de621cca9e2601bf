"""An async collective on real Gloo ranks, typed when its work is waited on: Gloo's
reduce-scatter into a tensor copies this rank's chunk into the output at ``handle.wait()``
(no torch.distributed frame on the stack), and that copy is the collective's own."""

import torch
import torch.distributed as dist

import shardcheck as sc
from shardcheck.parity.launch import spawn_ranks


def _reduce_scatter(async_op: bool, placement: str, overwrite: bool) -> dict:
    rank = dist.get_rank()
    full = torch.arange(8.0).view(4, 2)
    with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect"):
        x = sc.annotate(full / 2 if placement == "P" else full.clone(), tp=placement)
        out = torch.empty(2, 2)
        handle = dist.reduce_scatter_tensor(out, x, async_op=async_op)
        if async_op:
            handle.wait()
        if overwrite:  # the program's own untyped write after the collective
            out.copy_(torch.linalg.inv(torch.eye(2)))
        typed = repr(sc.typeof(out))
    return {"type": typed, "rules": [r.rule for r in sc.violations()],
            "right": torch.equal(out, full[2 * rank:2 * rank + 2]) or overwrite}


def test_an_async_reduce_scatter_is_typed_after_its_wait_like_a_sync_one():
    for async_op in (False, True):
        for result in spawn_ranks(_reduce_scatter, 2, async_op, "P", False):
            assert result == {"type": "{'tp': S(0)}", "rules": [], "right": True}


def test_an_async_reduce_scatter_of_a_replicated_value_is_still_reported():
    for result in spawn_ranks(_reduce_scatter, 2, True, "R", False):
        assert result["rules"] and not result["right"]


def test_only_the_collectives_own_copy_is_excused_a_later_untyped_write_is_not():
    for result in spawn_ranks(_reduce_scatter, 2, True, "P", True):
        assert result["type"] == "{}"
