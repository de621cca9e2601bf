"""Remembered outcomes of the typing rules that depend on their operands' signature alone.

A model makes the same op on operands of the same types and layouts again and again (its
layers, microbatches, forward and backward). The rules of the ops in :data:`MEMOISED` read
nothing but their operands' types, what is known of their values, shapes, strides and dtypes,
the non-tensor arguments, the mesh and whether a backward pass runs them; the checker keeps
each outcome (the result's placements and what is known of its value) by that
:func:`signature` and, meeting it again, types the result without running the rule
(:class:`~shardcheck.typecheck.checker.Checker`).

Whatever could make such a rule read more is kept out: an operand whose record holds any other
field (a broadcast tag, a cut, a norm term, an unknown's origin, ...; see :mod:`tensor_state`),
one tensor given twice (a square: norm accounting follows a gradient's), a list of tensors, an
argument other than a built-in number, a string, None or torch's dtypes and devices (an int
subclass remembering a rank), and a checker holding per-rank numbers, accumulations or code
branching on the rank (it bypasses the memo then). An outcome is kept only when its rule
returned a type without writing any record field and broke no rule: a violation is found
again each time. A rule registered by the user in place of a built-in one is never remembered.
"""

from __future__ import annotations

from typing import Any

import torch

from shardcheck.typecheck import tensor_state
from shardcheck.typecheck.rules import registry

# aten base names (in-place forms included) whose built-in rules read only what a signature holds:
# contractions, elementwise arithmetic (norm accounting looks past them unless an operand holds a
# norm term or both are one tensor), reductions, normalisations and activations with their backward.
# A rule of one of them that comes to read anything else (the autograd node, a checker's state, a
# tensor's values or storage) takes its op off this list, or puts what it reads in the signature.
MEMOISED = frozenset({
    "mm", "bmm", "addmm", "baddbmm",
    "add", "sub", "mul", "div", "masked_fill",
    "sum", "mean",
    "native_layer_norm", "native_layer_norm_backward", "_softmax", "_softmax_backward_data",
    "gelu", "gelu_backward", "silu", "silu_backward", "exp", "log",
})
# arguments compared by value: built-in numbers (not their subclasses, which may remember a rank
# and answer a comparison: see rank_branches), strings, None and torch's dtypes and devices
_PLAIN = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
_STRIDED = torch.strided
KEPT = 8192  # outcomes kept at most (all dropped past it)
# (placements, known value) by signature; a signature names its mesh, so regions share them
OUTCOMES: dict[tuple, tuple] = {}


def _builtin_rules() -> dict[Any, Any]:
    """Each overload of a memoised op and its built-in rule, as the table holds them now (at import,
    before any user registers one)."""
    rules = {}
    for name in MEMOISED:
        for variant in (name, name + "_"):
            packet = getattr(torch.ops.aten, variant, None)
            for overload in packet.overloads() if packet is not None else ():
                op = getattr(packet, overload)
                rules[op] = registry.rule_for(op)
    return rules


_BUILTIN = _builtin_rules()


def memoised(func: Any, rule: Any) -> bool:
    """Whether ``func``'s outcomes may be remembered: a memoised op typed by its built-in ``rule``."""
    return rule is not None and _BUILTIN.get(func) is rule


def keep(sig: tuple, pl: Any, flags: Any) -> None:
    """Remember the outcome of the op call of signature ``sig``."""
    if len(OUTCOMES) >= KEPT:
        OUTCOMES.clear()
    OUTCOMES[sig] = (pl, flags)


def signature(func_id: int, key: tuple, args: tuple, kwargs: dict) -> tuple | None:
    """What the rule of op ``func_id`` reads in the region of mesh ``key`` (an interned mesh
    key, which lives as long as the process: see checker.mesh_key): whether a backward pass
    runs it (a division by an even count: see rules.arithmetic), and of its arguments, per tensor
    its placements and known value there, shape, strides and dtype (a strided one only); per
    other argument (a plain value, or a list of them) its type and value. None where the op is
    not to be remembered (see the module). It runs at every call of a memoised op: the loop is
    inline."""
    parts: list[Any] = [func_id, id(key), torch._C._current_graph_task_id() >= 0]  # in a backward pass
    seen: list[int] = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            st = tensor_state.plain_type(value)
            if st is False or id(value) in seen or value.layout is not _STRIDED:  # sparse: no strides
                return None
            seen.append(id(value))
            parts.append((None, None, value.shape, value.stride(), value.dtype) if st is None or st[0] is not key
                         else (st[1], st[2], value.shape, value.stride(), value.dtype))
        elif type(value) in _PLAIN:
            parts.append((type(value), value))
        elif type(value) is list or type(value) is tuple:
            for v in value:
                if type(v) not in _PLAIN:
                    return None
            parts.append((type(value), tuple(value)))
        else:  # a number that remembers a rank (rank_branches), a tensor subclass's object, ...
            return None
    if kwargs:
        parts.append(tuple(kwargs))
    return tuple(parts)
