"""Hypothesis strategies for the oracle's SPMD programs (see :mod:`shardcheck.fuzz.oracle`).

A program has one to three inputs of one global shape, each with a placement per mesh axis,
and one to five steps drawn from the checker's rule tables, the collectives and the idioms of
:mod:`shardcheck.fuzz.oracle_ops`. Programs that cannot run (shapes that do not line up) are
rejected by :func:`shardcheck.fuzz.oracle.valid` before any rank sees them.
"""

from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st

from shardcheck.fuzz.oracle import (
    LAYOUTS,
    Input,
    Program,
    Step,
    global_inputs,
    local_inputs,
    rank_env,
    runs,
    single_env,
    valid,
)
from shardcheck.fuzz.oracle_ops import COLLECTIVES, SPECS

PLACEMENTS = ("R", "P", "S(0)", "S(1)", "I", "V")
SHAPE = (8, 8)
TRIES = 8
ATEN = tuple(name for name in SPECS if name not in COLLECTIVES)


_PLACEMENT = st.sampled_from(PLACEMENTS)
_OPS = st.one_of(st.sampled_from(ATEN), st.sampled_from(COLLECTIVES))
_CHOICES = {choices: st.sampled_from(choices) for spec in SPECS.values() for _, choices in spec.params}
_GROUPS = {groups: st.sampled_from(groups) for groups in (("tp",), ("tp", "dp", "world"))}


@st.composite
def inputs(draw, layout: str) -> Input:
    placements = tuple((axis, draw(_PLACEMENT)) for axis in LAYOUTS[layout])
    return Input(SHAPE, placements)


@st.composite
def steps(draw, count: int, groups: tuple[str, ...]) -> Step:
    op = draw(_OPS)
    spec = SPECS[op]
    args = tuple(draw(st.integers(0, count - 1)) for _ in range(spec.arity))
    params = tuple((key, draw(_GROUPS[groups] if key == "g" else _CHOICES[choices])) for key, choices in spec.params)
    return Step(op, args, params)


@st.composite
def programs(draw, layouts: tuple[str, ...] = ("tp2", "tp4", "tp2-dp2"), valid_only: bool = True) -> Program:
    """A program whose every step runs, in shapes, on a rank of ``layout`` and on one rank
    (each step is drawn again, up to a few times, until it does)."""
    layout = draw(st.sampled_from(layouts))
    groups = ("tp", "dp", "world") if len(LAYOUTS[layout]) > 1 else ("tp",)
    ins = tuple(draw(inputs(layout)) for _ in range(draw(st.integers(1, 3))))
    shell = Program(layout, ins, ())
    envs = (rank_env(layout, 0, "meta"), single_env("meta"))
    values = [local_inputs(shell)[0], global_inputs(shell)]
    body: list[Step] = []
    for _ in range(draw(st.integers(1, 5))):
        for _ in range(TRIES):
            step = draw(steps(len(ins) + len(body), groups))
            out = runs(step.op, envs, [[v[j] for j in step.args] for v in values], dict(step.params))
            if out is not None:
                break
        else:
            assume(False)
        body.append(step)
        for held, made in zip(values, out, strict=True):
            held.append(made)
    program = Program(layout, ins, tuple(body), draw(st.integers(0, 2**16)))
    if valid_only:
        assume(valid(program))
    return program
