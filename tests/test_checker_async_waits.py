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
    value = full / 2 if placement == "P" else full.clone()
    with sc.typecheck(sc.Mesh(tp=dist.group.WORLD), mode="collect", sites=True):
        x = sc.annotate(value, tp=placement)
        out = torch.empty(2, 2)
        handle = dist.reduce_scatter_tensor(out, x, async_op=async_op)
        if async_op:
            handle.wait()
        if overwrite:  # the program's own untyped write after the collective
            out.copy_(torch.linalg.inv(torch.eye(2)))
        typed = repr(sc.typeof(out))
    unknown_here = [site for site, _, unknown in sc.coverage().within(__file__).by_site if unknown]
    return {"type": typed, "rules": [r.rule for r in sc.violations()],
            "right": torch.equal(out, full[2 * rank:2 * rank + 2]) or overwrite,
            "unknown here": unknown_here if not overwrite else None}


def test_an_async_reduce_scatter_is_typed_after_its_wait_like_a_sync_one():
    for async_op in (False, True):
        for result in spawn_ranks(_reduce_scatter, 2, async_op, "P", False):
            # Gloo's cut of its reduced buffer and its copy into the output, made at the wait,
            # are the collective's own op calls: not unknowns of the caller's
            assert result == {"type": "{'tp': S(0)}", "rules": [], "right": True, "unknown here": []}


def test_an_async_reduce_scatter_of_a_replicated_value_is_still_reported():
    for result in spawn_ranks(_reduce_scatter, 2, True, "R", False):
        assert result["rules"] and not result["right"]


def test_only_the_collectives_own_copy_is_excused_a_later_untyped_write_is_not():
    for result in spawn_ranks(_reduce_scatter, 2, True, "P", True):
        assert result["type"] == "{}"


def test_a_split_of_an_unseen_tensor_is_unknown_when_no_collective_is_landing():
    made_outside = torch.ones(4, 2)
    with sc.typecheck(sc.Mesh(rank=0, tp=[0, 1]), sites=True):
        made_outside.split(2)
    assert sc.coverage().within(__file__).unknown == 1
