"""What a pipeline stage receives carries the sender's types.

Megatron's schedules move each microbatch's hidden states forward and their gradients back
between pipeline stages with point-to-point transfers (``_batched_p2p_ops`` or ``_p2p_ops``
of ``pipeline_parallel.p2p_communication``). A stage cannot type what another stage computed,
so inside a checked region every such transfer sends the type of the sent tensor beside it:
a fixed-size message on the same pipeline group under its own tag, posted right after the
data, so it adds no wait. When a receive is waited on, its buffer takes the sender's
placements on every axis but the pipeline's own, where it is V (each stage holds its own
microbatch's values). The sender and the receiver hold the same coordinates on the other
axes, so a shard on tp stays the same shard. A type that does not fit the message, or none,
leaves the buffer unknown, as before.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.patching import patched_attrs

TYPE_TAG = 0x5C1D  # the type messages' own tag: Megatron's transfers use 0
MESSAGE_BYTES = 512  # two bytes of length, then the pickled {axis: placement}

_P2P_FUNCTIONS = ("_batched_p2p_ops", "_p2p_ops")
_SLOTS = (("tensor_send_prev", "prev_pipeline_rank", True), ("tensor_recv_prev", "prev_pipeline_rank", False),
          ("tensor_send_next", "next_pipeline_rank", True), ("tensor_recv_next", "next_pipeline_rank", False))


def encode(types: dict[str, Any] | None) -> torch.Tensor:
    """``types`` (placements by axis name) as a message; no types, or too many bytes: empty."""
    payload = pickle.dumps(types) if types else b""
    if len(payload) > MESSAGE_BYTES - 2:
        payload = b""
    message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    message[:2] = torch.tensor([len(payload) % 256, len(payload) // 256], dtype=torch.uint8)
    if payload:
        message[2:2 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return message


def decode(message: torch.Tensor) -> dict[str, Any] | None:
    """The placements by axis name a message holds, or None."""
    length = int(message[0]) + 256 * int(message[1])
    return pickle.loads(bytes(message[2:2 + length].tolist())) if length else None


class _Waited:
    """A transfer's work that, once waited on, also finishes its type message (``then``)."""

    def __init__(self, work: Any, then: Callable[[], None]) -> None:
        self._work, self._then = work, then

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        done = self._work.wait(*args, **kwargs)
        self._then()
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _once(action: Callable[[], None]) -> Callable[[], None]:
    done = []

    def run() -> None:
        if not done:
            done.append(True)
            action()
    return run


def _sent_types(checker: Any, tensor: torch.Tensor) -> dict[str, Any] | None:
    pl = checker.types(tensor)
    return None if pl is None else {n: p for n, p in zip(checker.names, pl, strict=True) if p is not None}


def _received(checker: Any, tensor: torch.Tensor, message: torch.Tensor, pipeline: set[str]) -> None:
    from shardcheck.typecheck.types import V

    types = decode(message)
    if types is not None:
        checker.set_type(tensor, tuple(V if name in pipeline else types.get(name) for name in checker.names))


def _exchange(checker: Any, group: Any, transfers: list[tuple[torch.Tensor, int, bool]]) -> list[Callable[[], None]]:
    """Post the type message of each (tensor, peer, is_send) transfer; what to do once each
    transfer is waited on."""
    from shardcheck.typecheck.rules.collectives import group_ranks

    pipeline = set(checker.mesh.axes_of(group_ranks(group)) or ())
    finishers = []
    for tensor, peer, is_send in transfers:
        if is_send:
            work = dist.isend(encode(_sent_types(checker, tensor)), dst=peer, group=group, tag=TYPE_TAG)
            finishers.append(_once(work.wait))
        else:
            message = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
            work = dist.irecv(message, src=peer, group=group, tag=TYPE_TAG)

            def finish(work=work, tensor=tensor, message=message) -> None:
                work.wait()
                with checker.paused():
                    _received(checker, tensor, message, pipeline)
            finishers.append(_once(finish))
    return finishers


def _typed_transfers(original: Callable[..., Any]) -> Callable[..., Any]:
    def run(**kwargs: Any) -> Any:
        from shardcheck.typecheck.checker import current

        reqs = original(**kwargs)
        checker = current()
        if checker is None:
            return reqs
        present = [(slot, peer, is_send) for slot, peer, is_send in _SLOTS if kwargs.get(slot) is not None]
        with checker.paused():
            finishers = _exchange(checker, kwargs["group"],
                                  [(kwargs[slot], kwargs[peer], is_send) for slot, peer, is_send in present])
        return _finishing(reqs, finishers, [slot for slot, _, _ in present])
    run.__name__ = original.__name__
    return run


def _finishing(reqs: Any, finishers: list[Callable[[], None]], slots: list[str]) -> Any:
    """``reqs`` with each transfer's work finishing its type message when waited on: a list in
    the order of the transfers (``_batched_p2p_ops``), or a dict by transfer name."""
    if isinstance(reqs, dict):
        by_slot = dict(zip((s.removeprefix("tensor_") for s in slots), finishers, strict=True))
        return {name: _Waited(work, by_slot[name]) if name in by_slot else work
                for name, work in reqs.items()}
    if len(reqs) != len(finishers):  # not one work per transfer: finish them all on each wait
        def finish_all() -> None:
            for finish in finishers:
                finish()
        return [_Waited(work, finish_all) for work in reqs]
    return [_Waited(work, finish) for work, finish in zip(reqs, finishers, strict=True)]


def received_activations_typed() -> contextlib.AbstractContextManager:
    """Inside: Megatron's pipeline transfers send their tensors' types (see the module)."""
    from megatron.core.pipeline_parallel import p2p_communication

    return patched_attrs([(p2p_communication, name, _typed_transfers(getattr(p2p_communication, name)))
                          for name in _P2P_FUNCTIONS if hasattr(p2p_communication, name)])
