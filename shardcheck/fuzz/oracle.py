"""The type checker's numeric oracle: run a small SPMD program on real Gloo ranks under the
checker and once on one rank, and judge the checker's verdict against the numbers.

A :class:`Program` is a list of inputs (a global shape and a placement per mesh axis) and a
list of steps (an op of :data:`shardcheck.fuzz.oracle_ops.OPS` on earlier values). Each rank gets
its local piece of every input (S(d): its chunk; P: random parts that sum to the global
value; R and I: the whole; V: a value of its own), runs the steps under ``typecheck`` in
collect mode and sends back every value, its checked type and the first step the checker
flagged. The one-rank run executes the same steps with groups of size 1 on the global inputs.

Truth, per step: the step's per-rank values are *representable* when some placement per axis
(R, P, S(d)) or the checker's own type rebuilds the one-rank value. The program is *wrong* at its first
step that is not. A step that depends on a V input, or on a step the checker typed V without
a report, has no global value to compare with (the checker made no claim): it is *undecided*.
The checker agrees with the numbers when

* it reports nothing on a right program and every type it gives rebuilds the one-rank value;
* it reports, on a wrong program, exactly the first wrong step, and every type it gave before
  rebuilds the one-rank value.

Otherwise the program is a *false alarm* (a report at a representable step) or a *miss* (a
wrong step, or a wrong type, not reported).
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardcheck.fuzz.oracle_ops import OPS, Env
from shardcheck.parity.layout import Layout
from shardcheck.typecheck.checker import typecheck
from shardcheck.typecheck.types import (
    PAVG,
    PEVEN,
    BlockShard,
    Gathered,
    Mesh,
    P,
    Placement,
    SectionShard,
    Shard,
    V,
    parse_placement,
)

# The mesh axes of each layout, fastest-varying first; "world" spans both axes of tp2-dp2.
LAYOUTS: dict[str, tuple[str, ...]] = {"tp2": ("tp",), "tp4": ("tp",), "tp2-dp2": ("tp", "dp")}
GROUP_AXES: dict[str, tuple[str, ...]] = {"tp": ("tp",), "dp": ("dp",), "world": ("tp", "dp")}
SEED_SCALE = 1.0
OUTSIDE = "outside"  # an encoded shard that holds the other axes' pieces of its dim


@dataclass(frozen=True)
class Input:
    """A program input: its global shape and placement per axis ("R", "P", "S(0)", "V", "I")."""

    shape: tuple[int, ...]
    placements: tuple[tuple[str, str], ...]

    def placement(self, axis: str) -> str:
        return dict(self.placements).get(axis, "R")


@dataclass(frozen=True)
class Step:
    """``op`` (a name in OPS) applied to earlier values ``args`` (indices) with ``params``."""

    op: str
    args: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Program:
    """An SPMD program on ``layout``; ``seed`` draws its global inputs and partial parts."""

    layout: str
    inputs: tuple[Input, ...]
    steps: tuple[Step, ...]
    seed: int = 0

    @property
    def axes(self) -> tuple[str, ...]:
        return LAYOUTS[self.layout]


# --- the execution environment --------------------------------------------------------------

def rank_env(layout: str, rank: int, mode: str, groups: dict[str, Any] | None = None) -> Env:
    """The environment of global ``rank`` on ``layout`` (sizes and indices per group name)."""
    sizes, ranks = _group_positions(layout, rank)
    return Env(mode, sizes, ranks, groups)


@functools.cache
def _group_positions(layout: str, rank: int) -> tuple[dict[str, int], dict[str, int]]:
    grid = Layout.parse(layout)
    sizes, ranks = {}, {}
    for name in ("tp", "dp", "world"):
        members = grid.group_ranks(name, rank)
        sizes[name], ranks[name] = len(members), members.index(rank)
    return sizes, ranks


def single_env(mode: str = "single") -> Env:
    return Env(mode, dict.fromkeys(("tp", "dp", "world"), 1), dict.fromkeys(("tp", "dp", "world"), 0))


# --- inputs ---------------------------------------------------------------------------------

@functools.cache
def coords(layout: str, rank: int) -> tuple[int, ...]:
    """``rank``'s coordinate on each axis of ``layout`` (fastest first)."""
    grid = Layout.parse(layout)
    return tuple(grid.coords(rank)[axis] for axis in LAYOUTS[layout])


@functools.cache
def _sizes(layout: str) -> tuple[int, ...]:
    grid = Layout.parse(layout)
    return tuple(grid.size(axis) for axis in LAYOUTS[layout])


def global_inputs(program: Program) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(program.seed)
    return [torch.randn(*i.shape, generator=gen, dtype=torch.float64) for i in program.inputs]


def local_inputs(program: Program) -> list[list[torch.Tensor]]:
    """Every rank's local pieces of the inputs: split on the slowest axis first, so that the
    fastest axis is the inner one (a group over both axes orders its ranks that way)."""
    sizes, axes = _sizes(program.layout), program.axes
    world = 1
    for s in sizes:
        world *= s
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for index, (value, inp) in enumerate(zip(global_inputs(program), program.inputs, strict=True)):
        pieces = {(): value}
        for a in reversed(range(len(axes))):
            placement = inp.placement(axes[a])
            pieces = {(c, *key): part for key, whole in pieces.items()
                      for c, part in enumerate(_split(whole, placement, sizes[a], (program.seed, index, a)))}
        for rank in range(world):
            per_rank[rank].append(pieces[coords(program.layout, rank)].contiguous())
    return per_rank


def _split(value: torch.Tensor, placement: str, n: int, salt: tuple) -> list[torch.Tensor]:
    """``value``'s pieces over an axis of ``n`` ranks; P and V draw from a generator seeded by
    ``salt`` and the value, so that replicas of one value get the same pieces."""
    p = parse_placement(placement)
    gen = torch.Generator().manual_seed(hash((*salt, tuple(value.shape), round(float(value.sum()), 6))) % 2**31)
    if isinstance(p, Shard):
        return list(value.chunk(n, p.dim))
    if p is P:
        parts = [torch.randn(value.shape, generator=gen, dtype=value.dtype) for _ in range(n - 1)]
        return [*parts, value - sum(parts, torch.zeros_like(value))]
    if p is V:
        return [torch.randn(value.shape, generator=gen, dtype=value.dtype) for _ in range(n)]
    return [value.clone() for _ in range(n)]


# --- running --------------------------------------------------------------------------------

def execute(program: Program, env: Env, inputs: Sequence[torch.Tensor],
            on_step: Callable[[int, Any], None] | None = None) -> list[torch.Tensor]:
    """Run the steps on ``inputs``; return inputs and step results, in order."""

    values = list(inputs)
    for i, step in enumerate(program.steps):
        scope = {"op": OPS[step.op], "env": env, "args": [values[j] for j in step.args],
                 "params": dict(step.params)}
        exec(_step_code(i), scope)  # the checker locates what it reports at "<step i>"
        out = scope["out"]
        values.append(out)
        if on_step is not None:
            on_step(i, out)
    return values


@functools.cache
def _step_code(i: int):
    return compile("out = op(env, *args, **params)", f"<step {i}>", "exec")


def reference(program: Program) -> list[torch.Tensor]:
    """The one-rank run: every group of size 1, on the global inputs."""
    return execute(program, single_env(), global_inputs(program))


def valid(program: Program) -> bool:
    """Whether every rank can run the program (shapes, divisibility) with equal local shapes
    at every step, and the one-rank run gives finite values; checked without any rank."""
    try:
        shapes = []
        for rank, pieces in enumerate(local_inputs(program)):
            shapes.append([tuple(v.shape) for v in execute(program, rank_env(program.layout, rank, "meta"), pieces)])
        if any(s != shapes[0] for s in shapes):
            return False
        return all(bool(torch.isfinite(v).all()) for v in reference(program))
    except (RuntimeError, ValueError, IndexError, TypeError, ZeroDivisionError):
        return False


def runs(op: str, envs: Sequence[Env], args: Sequence[Sequence[torch.Tensor]], params: dict) -> list | None:
    """One step's meta results in each environment, or None when it cannot run there."""

    try:
        return [OPS[op](env, *values, **params) for env, values in zip(envs, args, strict=True)]
    except (RuntimeError, ValueError, IndexError, TypeError, ZeroDivisionError):
        return None


def encode(p: Placement | None) -> tuple | None:
    """A placement as plain data (the checker's own kinds included), to leave the rank."""
    if p is None:
        return None
    if isinstance(p, Shard):
        return _shard_kind(p) + ((OUTSIDE,) if p.outside else ())
    if isinstance(p, Gathered):
        return ("G", p.dim)
    if p is PAVG:
        return ("PAVG",)
    if p is PEVEN:
        return ("P",)
    return (p.symbol,)


def on_rank(ctx, program: Program, per_rank: list[list[torch.Tensor]]) -> dict[str, Any]:
    """A pool job: run ``program`` on this rank under the checker (collect mode)."""
    env = rank_env(program.layout, ctx.rank, "dist", {name: ctx.groups[name] for name in ("tp", "dp", "world")})
    mesh = Mesh(rank=ctx.rank, **{axis: ctx.groups[axis] for axis in program.axes})
    types: list[tuple | None] = []
    records: list[dict[str, Any]] = []
    with contextlib.redirect_stderr(io.StringIO()), typecheck(mesh, mode="collect") as checker:
        from shardcheck.typecheck.checker import annotate

        inputs = []
        for value, inp in zip(per_rank[ctx.rank], program.inputs, strict=True):
            inputs.append(annotate(value.clone(), **{a: inp.placement(a) for a in program.axes}))

        def record(i: int, out: Any) -> None:
            types.append(_types_of(checker, out))
            records.extend(r.as_dict() for r in checker.records[len(records):])

        values = execute(program, env, inputs, record)
    return {"values": [v.detach().clone() for v in values[len(inputs):]], "types": types,
            "records": records}


def _types_of(checker, out: Any) -> tuple | None:
    pl = checker.types(out) if isinstance(out, torch.Tensor) else None
    if pl is None:
        return None
    if checker.accumulated(out):  # see _read_accumulated
        return tuple(("ACC", encode(p)) for p in pl)
    if checker.zero(out):
        return tuple(("ZERO", encode(p)) for p in pl)
    return tuple(encode(p) for p in pl)


def _read_accumulated(layout: str, types: Sequence[tuple | None]) -> tuple | None:
    """The ranks' types as one claim. On an axis, zeros a value was added into (ACC) are R
    where every rank of the axis' groups added, and the contributions of a sum (P) where the
    others hold zeros; zeros alone are R."""
    if any(t is None for t in types) or len({len(t) for t in types}) != 1:
        return None
    claim = []
    for a in range(len(types[0])):
        kinds = {t[a] for t in types}
        if all(k is not None and k[0] in ("ACC", "ZERO") for k in kinds):
            inner = {k[1] for k in kinds}
            groups: dict[tuple, set] = {}
            for r, t in enumerate(types):
                key = coords(layout, r)
                groups.setdefault(key[:a] + key[a + 1:], set()).add(t[a][0])
            mixed = {len(g) > 1 for g in groups.values()}
            if len(inner) != 1 or len(mixed) != 1:
                return None
            if mixed == {True}:  # added on some ranks of the axis only: their contributions
                if inner not in ({("R",)}, {("I",)}):
                    return None
                claim.append(("P",))
            else:
                claim.append(inner.pop())
        elif len(kinds) == 1:
            claim.append(types[0][a])
        else:
            return None
    return tuple(claim)


def first_report(results: Sequence[dict[str, Any]]) -> tuple[int, str] | None:
    """The first step the checker reported, by the reports the ranks confirm together."""
    from shardcheck.typecheck.checker import confirmed_across_ranks

    confirmed = confirmed_across_ranks(r["records"] for r in results)
    return min(((int(v["location"].split()[1].split(">")[0]), v["rule"]) for v in confirmed), default=None)


# --- judging --------------------------------------------------------------------------------

def tolerance(reference: torch.Tensor) -> float:
    scale = reference.abs().max().item() if reference.numel() else 0.0
    return 1e-6 * max(1.0, scale)  # float64 values; a cast to float32 and back stays within


def _shard_kind(p: Shard) -> tuple:
    if type(p) is BlockShard:
        return ("B", p.dim, p.outer)
    if type(p) is SectionShard:
        return ("SEC", p.dim, p.sections)
    return ("S", p.dim)


def _join_order(types: Sequence[tuple | None]) -> list[int]:
    """The axes in the order their pieces join, innermost first: by the mesh (fastest first),
    except that a shard marked outside holds the other axes' pieces of its dim, so it joins
    after them."""
    return sorted(range(len(types)), key=lambda a: types[a] is not None and types[a][-1] == OUTSIDE)


def rebuild(layout: str, values: Sequence[torch.Tensor], types: Sequence[tuple | None]) -> torch.Tensor | None:
    """The global value of per-rank ``values`` under ``types`` (one encoded placement per axis),
    or None when the types give none (V, unknown) or the replicas disagree."""
    sizes = _sizes(layout)
    items = {coords(layout, r): v for r, v in enumerate(values)}
    stacked = [a for a, t in enumerate(types) if t is not None and t[0] == "G"]
    sharded = [a for a, t in enumerate(types) if t is not None and t[0] in ("S", "SEC", "B")]
    if stacked and sharded and any(types[a][1] == types[stacked[0]][1] for a in sharded):
        return _rebuild_in_order(items, types, sizes)  # blocks of a dim sharded on other axes
    if stacked:  # gathered blocks: replicas on those axes, then unstacked over all of them
        if len({types[a][1] for a in stacked}) > 1:
            return None
        try:
            items = _unstack(items, stacked, sizes, types[stacked[0]][1])
        except RuntimeError:
            return None
        if items is None:
            return None
        types = [("R",) if a in stacked else t for a, t in enumerate(types)]
    return _merge_axes(items, sizes, lambda a, parts: _combine(types[a], parts), _join_order(types))


def _rebuild_in_order(items: dict, types, sizes) -> torch.Tensor | None:
    """Axes combined fastest first, a gathered axis unstacking its blocks at its turn: the
    inner axes' pieces join inside each block first."""
    def combine(a: int, parts: list) -> torch.Tensor | None:
        if types[a][0] != "G":
            return _combine(types[a], parts)
        whole = _combine(("R",), parts)
        whole = None if whole is None else _unstack({(): whole}, [a], sizes, types[a][1])
        return None if whole is None else whole[()]

    return _merge_axes(items, sizes, combine, _join_order(types))


def _merge_axes(items: dict, sizes, combine, order: list[int] | None = None) -> torch.Tensor | None:
    """Join the pieces keyed by coordinate one axis at a time, in ``order`` (innermost first;
    the mesh's by default), (``combine(axis, parts)``, None when they don't join) into the
    single global value."""
    for a in order if order is not None else range(len(sizes)):
        size = sizes[a]
        merged = {}
        for key in {k[:a] + (None,) + k[a + 1:] for k in items}:
            whole = combine(a, [items[key[:a] + (c,) + key[a + 1:]] for c in range(size)])
            if whole is None:
                return None
            merged[key] = whole
        items = merged
    return next(iter(items.values()))


def _unstack(items: dict, axes: list[int], sizes: tuple[int, ...], dim: int) -> dict | None:
    """Per coordinate, the value whose dim-0 blocks (one per rank of ``axes``) join along ``dim``."""
    count = 1
    for a in axes:
        count *= sizes[a]
    out = {}
    for key, value in items.items():
        if value.dim() <= dim or value.shape[0] % count:
            return None
        out[key] = torch.cat(value.chunk(count, 0), dim)
    return out


def _combine(p: tuple | None, parts: list[torch.Tensor]) -> torch.Tensor | None:
    try:
        return _combined(p, parts)
    except (RuntimeError, IndexError, ValueError):  # the type does not fit these local shapes
        return None


def _combined(p: tuple | None, parts: list[torch.Tensor]) -> torch.Tensor | None:
    kind = None if p is None else p[0]
    if kind in ("R", "I"):
        tol = tolerance(parts[0])
        if any(q.shape != parts[0].shape or (q.numel() and (q - parts[0]).abs().max().item() > tol)
               for q in parts):
            return None
        return parts[0]
    if any(q.shape != parts[0].shape for q in parts):
        return None
    if kind == "P":
        return torch.stack(parts).sum(0)
    if kind == "PAVG":
        return torch.stack(parts).mean(0)
    if kind == "S":
        return torch.cat(parts, p[1]) if parts[0].dim() > p[1] else None
    if kind == "B":
        d, outer = p[1], p[2]
        blocks = [q.chunk(outer, d) for q in parts]
        return torch.cat([torch.cat([b[i] for b in blocks], d) for i in range(outer)], d)
    if kind == "SEC":  # the sections of pieces that inner axes joined already are as many times longer
        d, local = p[1], sum(p[2])
        if parts[0].shape[d] % local:
            return None
        bounds = [b * (parts[0].shape[d] // local) for b in itertools.accumulate(p[2], initial=0)]
        return torch.cat([torch.cat([q.narrow(d, bounds[i], bounds[i + 1] - bounds[i]) for q in parts], d)
                          for i in range(len(p[2]))], d)
    return None


def matches(layout: str, values: Sequence[torch.Tensor], types: Sequence[tuple | None],
            truth: torch.Tensor) -> bool:
    whole = rebuild(layout, values, types)
    return (whole is not None and whole.shape == truth.shape
            and (not truth.numel() or (whole - truth).abs().max().item() <= tolerance(truth)))


def representable(layout: str, values: Sequence[torch.Tensor], truth: torch.Tensor) -> bool:
    """Whether some placement per axis (R, P, S(d)) rebuilds ``truth``. P is tried only on
    axes whose ranks hold different values: equal values read as a sum would let a value off
    by the axis size pass (another axis of that size). A partial mean is not tried: with a sum
    on another axis of the same size it would let a value off by that size pass; a partial
    mean the checker claims is compared as claimed."""
    ndim = values[0].dim()
    per_axis = []
    for a in range(len(_sizes(layout))):
        kinds = [("R",), *(("S", d) for d in range(ndim))]
        if not _replicas_agree(layout, values, a):
            kinds.append(("P",))
        per_axis.append(kinds)
    return any(matches(layout, values, choice, truth) for choice in itertools.product(*per_axis))


def _replicas_agree(layout: str, values: Sequence[torch.Tensor], axis: int) -> bool:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for r, v in enumerate(values):
        key = coords(layout, r)
        groups.setdefault(key[:axis] + key[axis + 1:], []).append(v)
    return all(_agree(g) for g in groups.values())


@dataclass
class OracleVerdict:
    """The oracle's verdict on the checker's report of one program: right, wrong, a false alarm, a
    miss, undecided, or an error (not the verdict on a fuzz example: :class:`~shardcheck.fuzz.trial.ExampleVerdict`)."""

    outcome: str  # "right", "wrong", "false alarm", "miss", "undecided", "error"
    first_wrong: int | None = None
    flagged: tuple[int, str] | None = None
    why: str = ""
    steps: list[str] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return self.outcome in ("right", "wrong", "undecided")


def judge(program: Program, results: Sequence[dict[str, Any]]) -> OracleVerdict:
    """Compare the checker's report and types (``results``, one per rank) with the numbers."""
    truth = reference(program)[len(program.inputs):]
    flagged = first_report(results)
    base = len(program.inputs)
    tainted = {i for i, inp in enumerate(program.inputs) if "V" in dict(inp.placements).values()}
    notes: list[str] = []
    last = flagged[0] if flagged is not None else len(program.steps) - 1
    for i, step in enumerate(program.steps[:last + 1]):
        values = [r["values"][i] for r in results]
        types = [r["types"][i] for r in results]
        typed = _read_accumulated(program.layout, types)
        claims = typed is not None and _claims(typed)
        reported = flagged is not None and i == flagged[0]
        if any(a in tainted for a in step.args) or _reads_varying(program, step, results[0]["types"]):
            tainted.add(base + i)
            if reported:
                return OracleVerdict("undecided", None, flagged, f"step {i} ({step.op}) reported on a value "
                               "without a global value", notes)
            if claims and all(t[0] in ("R", "I") for t in typed) and not _agree(values):
                return OracleVerdict("miss", None, flagged, f"step {i} ({step.op}) typed {_show(typed)}: ranks differ")
            notes.append(f"{i} {step.op}: undecided, typed {_show(typed)}")
            continue
        fits = claims and matches(program.layout, values, typed, truth[i])
        if _constant(values, truth[i]):  # every placement fits a constant: nothing to judge
            tainted.add(base + i)
            notes.append(f"{i} {step.op}: constant, typed {_show(typed)}")
            if reported:
                return OracleVerdict("undecided", None, flagged, f"step {i} ({step.op}) reported on a constant", notes)
            continue
        ok = fits or representable(program.layout, values, truth[i])
        notes.append(f"{i} {step.op}: {'fits' if ok else 'WRONG'}, typed {_show(typed)}")
        if reported:
            if ok and _reads_constant(program, step, truth):
                return OracleVerdict("undecided", None, flagged, f"step {i} ({step.op}) reported; it reads a value "
                               "constant on one rank, whose parts may cancel a broken rule out", notes)
            if ok:
                return OracleVerdict("false alarm", None, flagged,
                               f"step {i} ({step.op}) reported {flagged[1]!r}; its numbers fit a placement", notes)
            return OracleVerdict("wrong", i, flagged, "", notes)
        if claims and not fits:
            return OracleVerdict("miss", None if ok else i, flagged,
                           f"step {i} ({step.op}) typed {_show(typed)}, its numbers say otherwise"
                           + ("" if ok else " (no placement fits)"), notes)
        if not ok:
            return OracleVerdict("undecided", i, flagged, f"step {i} ({step.op}) typed {_show(typed)}: no claim", notes)
        if not claims:
            tainted.add(base + i)
    if any(base + i in tainted for i in range(len(program.steps))) and flagged is None:
        return OracleVerdict("undecided", None, None, "a value without a claimed global value", notes)
    return OracleVerdict("right", None, None, "", notes)


# Ops that cut their input along a dim before moving the pieces: the cut dim (param or fixed).
_CUTS = {"reduce_scatter_list": "dim", "all_to_all_list": "dim", "scatter": "dim",
         "f_reduce_scatter": "dim", "reduce_scatter_last_dim": -1, "sp_to_hp": 1}


def _reads_varying(program: Program, step: Step, step_types: Sequence[tuple | None]) -> bool:
    """Whether a collective step moves values that are V on its group's axes, or cuts a shard
    along its own dim (pieces that are V): what it makes of them the numbers cannot decide."""
    params = dict(step.params)
    if "g" not in params:
        return False
    axes = [program.axes.index(a) for a in GROUP_AXES[params["g"]] if a in program.axes]
    base = len(program.inputs)
    for j in step.args:
        if j < base:
            typed = tuple(encode(parse_placement(program.inputs[j].placement(a))) for a in program.axes)
        else:
            typed = step_types[j - base]
        if typed is None:
            continue
        cut = _CUTS.get(step.op)
        cut = params.get(cut) if isinstance(cut, str) else cut
        for a in axes:
            t = typed[a]
            if t is not None and (t[0] == "V" or (cut is not None and t[0] == "S" and _same_dim(t[1], cut, step))):
                return True
    return False


def _same_dim(d: int, cut: int, step: Step) -> bool:
    return d == cut or (cut < 0 and d >= 0 and d == 1) or (d < 0 and cut == 1)


def _constant(values: Sequence[torch.Tensor], truth: torch.Tensor) -> bool:
    """Every element of every rank's value and of the one-rank value equal (``x - x``, a
    softmax over a dim of size 1): R, P and every shard rebuild it alike."""
    if not truth.numel():
        return True
    c = truth.flatten()[0]
    tol = tolerance(truth)
    return (truth - c).abs().max().item() <= tol and all(
        v.numel() and (v - c).abs().max().item() <= tol for v in values)


def _reads_constant(program: Program, step: Step, truth: Sequence[torch.Tensor]) -> bool:
    """Whether ``step`` reads a step's value that is constant on one rank (``x - x``): the
    ranks' parts of it may differ, and a rule broken on them (a product of partial sums) can
    cancel out in the numbers."""
    base = len(program.inputs)
    return any(j >= base and _constant([], truth[j - base]) for j in step.args)


def _claims(typed: tuple) -> bool:
    """Whether a type claims a global value on every axis (V or unknown claims none)."""
    return all(t is not None and t[0] not in ("V",) for t in typed)


def _agree(values: Sequence[torch.Tensor]) -> bool:
    return all(v.shape == values[0].shape and (not v.numel() or (v - values[0]).abs().max().item()
                                               <= tolerance(values[0])) for v in values)


def _show(typed: tuple | None) -> str:
    if typed is None:
        return "?"
    return "(" + ", ".join("?" if t is None else t[0] if len(t) == 1 else f"{t[0]}{t[1:]}" for t in typed) + ")"


def check(pool, program: Program) -> OracleVerdict:
    """Run ``program`` on the pool's ranks and judge it (outcome "error" when a rank failed)."""
    from shardcheck.parity.pool import PoolFailure

    try:
        results = pool.run(program.layout, on_rank, program, local_inputs(program), timeout=30)
    except PoolFailure as failure:
        return OracleVerdict("error", why=str(failure).splitlines()[-1])
    return judge(program, results)
