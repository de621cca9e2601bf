"""The SPMD type checker: a TorchDispatchMode that types every op per mesh axis.

Types live on the tensors themselves (the ``type`` of their :mod:`tensor_state` record: the
mesh key, one placement per mesh axis or None where unknown, and what is known of its value:
nothing, every element equal (CONST: e.g. the ones that seed a backward pass), or all zero).
Views of a tensor are remembered on their base (``views``), so in-place ops and in-place
collectives retype every tracked tensor that views the same storage.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardcheck.typecheck import op_memo, rank_branches, tensor_state, unknown_origins, unseen
from shardcheck.typecheck.broadcast import op_kind as broadcast_kind
from shardcheck.typecheck.broadcast import record as record_broadcast
from shardcheck.typecheck.locations import (
    engine_node,
    inside_collective,
    op_site,
    user_location,
    violation_site,
)
from shardcheck.typecheck.position_cuts import PositionCuts
from shardcheck.typecheck.rank_values import RankValues
from shardcheck.typecheck.rules import registry
from shardcheck.typecheck.rules.common import NO_TENSOR, is_partial, replicated, stacks_as_pieces
from shardcheck.typecheck.rules.registry import (
    ACC,
    CONST,
    FILL_VALUE_POS,
    NOTHING,
    WITH_ACC,
    ZERO,
    Known,
    ValueRule,
    base_name,
)
from shardcheck.typecheck.type_store import LAYOUT_EPOCH, TypeStore
from shardcheck.typecheck.types import (
    Mesh,
    Placement,
    S,
    Shard,
    V,
    parse_alternatives,
    parse_placement,
)
from shardcheck.typecheck.violations import HELP, SpmdTypeError, Violation, ViolationRecord

# By id(op), what the dispatch needs of it (see _resolve), kept while no rule is registered or
# unregistered; and the op itself (for coverage's names).
_ENTRIES: dict[int, OpEntry] = {}
_OPS: dict[int, Any] = {}
registry.on_change(_ENTRIES.clear)
_MESH_KEYS: dict[tuple, tuple] = {}
_ARITH, _ADD, _KEEP = ValueRule.ARITH, ValueRule.ADD, ValueRule.KEEP  # read at every op (an enum member costs 0.1 µs)
_ACTIVE: list[Checker] = []
_LAST: list[Checker] = []


# Collectives that Gloo runs as an all-reduce of a buffer the checker never sees, then, when
# the work is waited on, copy this rank's chunk of it into the output: the first untyped write
# into the output after the op is that copy, the collective's own (an async op is waited on
# at ``handle.wait()``, with no torch.distributed frame on the stack).
_LANDS_ON_WAIT = frozenset({torch.ops.c10d._reduce_scatter_base_.default})
_LANDING_NAMES = frozenset({"copy", "split"})  # the ops that land one (see Checker._landing)


def confirmed_across_ranks(per_rank: Iterable[Iterable[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    """Every rank's violations (``ViolationRecord.as_dict``), one per rule and location.

    A "split of varying" found by the rank-slice heuristic is kept only when ranks at two or more
    coordinates of its axis report it at the same occurrence: slicing by rank makes every rank
    cut its own piece there, while a fixed index (``values[layer]``) matches one rank's piece
    only, each time on another rank.
    """
    reports = [v for rank in per_rank for v in rank]
    cut_by_rank = {(v["location"], v["occurrence"]) for v in reports if v.get("occurrence") is not None
                   and len({w["coordinate"] for w in reports if w.get("occurrence") == v["occurrence"]
                            and w["location"] == v["location"]}) > 1}
    kept: dict[tuple[str, str], Mapping[str, Any]] = {}
    for v in reports:
        if v.get("occurrence") is None or (v["location"], v["occurrence"]) in cut_by_rank:
            kept.setdefault((v["rule"], v["location"]), v)
    return list(kept.values())


@dataclass
class Coverage:
    """How many op calls got a typed result, and which ops most often did not."""

    typed: int = 0
    unknown: int = 0
    top_unknown: list[tuple[str, int]] = field(default_factory=list)
    # with typecheck(..., sites=True): (file:line, typed, unknown) per call site, most unknown
    # first; where unknown values began and why ("file:line op: cause", op calls they reached,
    # most first), and those calls by their own site ((origin, file:line, calls): ``reached``)
    by_site: list[tuple[str, int, int]] = field(default_factory=list)
    origins: list[tuple[str, int]] = field(default_factory=list)
    reached: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        total = self.typed + self.unknown
        return self.typed / total if total else 1.0

    def within(self, prefix: str) -> Coverage:
        """The share of op calls made from files under ``prefix`` (e.g. megatron-core's)."""
        sites = [s for s in self.by_site if s[0].startswith(prefix)]
        reached = [r for r in self.reached if r[1].startswith(prefix)]
        origins = Counter()
        for origin, _, calls in reached:
            origins[origin] += calls
        return Coverage(sum(s[1] for s in sites), sum(s[2] for s in sites), [], sites,
                        origins.most_common(), reached)

    def __str__(self) -> str:
        lines = [f"typed {self.typed} of {self.typed + self.unknown} op calls "
                 f"({100 * self.fraction:.1f}%)"]
        lines += [f"  unknown {name}: {count}" for name, count in self.top_unknown]
        lines += [f"  unknown from {origin}: {count}" for origin, count in self.origins]
        return "\n".join(lines)


def mesh_key(mesh: Mesh) -> tuple:
    """An interned key: equal meshes share one key object, so a type check is an ``is``."""
    key = (mesh.rank, *((a.name, a.ranks) for a in mesh.axes.values()))
    return _MESH_KEYS.setdefault(key, key)


class Checker(TypeStore, RankValues, TorchDispatchMode):
    """Types every dispatched op on ``mesh``; ``mode`` is "raise" or "collect"."""

    rerun = False  # see _VaryingOn

    def __init__(self, mesh: Mesh, mode: str = "raise", sites: bool = False) -> None:
        super().__init__()
        if mode not in ("raise", "collect"):
            raise ValueError(f"mode must be 'raise' or 'collect', not {mode!r}")
        self.mesh, self.mode = mesh, mode
        self.key = mesh_key(mesh)
        LAYOUT_EPOCH[0] += 1  # tensors may have moved since the last region
        self.names = mesh.names
        self.n = len(self.names)
        self.sizes = tuple(a.size for a in mesh.axes.values())
        self.check_gradients_on_step = True  # sc.check_gradients before every optimizer.step()
        self.index = tuple(a.ranks.index(mesh.rank) if mesh.rank in a.ranks else -1
                           for a in mesh.axes.values())
        self.rank_sets = tuple(frozenset(a.ranks) for a in mesh.axes.values())
        self.typed = 0
        self.unknown: Counter = Counter()
        self.records: list[ViolationRecord] = []
        self._seen: set[tuple[str, str]] = set()
        self._paused = False
        self.varying_cuts = 0
        self.accumulating = False  # whether any op made ACC | ONE_RANK zeros yet (see _after_accumulation)
        self._pieces: tuple | None = None  # the latest split's pieces (see remember_pieces)
        # by value: the axes a number read from a per-rank value differs on, and the frame that read it
        self.rank_scalars: dict[int | float, tuple[tuple[int, ...], tuple | None]] = {}
        self.branches = rank_branches.RankBranches()
        # with ``sites``: op calls per source location [typed, unknown], and where unknowns began
        self.sites: dict[str, list[int]] | None = {} if sites else None
        self.origins: Counter = Counter()
        self.landings: Counter = Counter()  # shapes of outputs an async collective lands on at wait
        self.cuts = PositionCuts()
        self.reshaped: dict[tuple, tuple] = {}  # forward views by (output, input) shape, see rules.shape


    # --- dispatch ----------------------------------------------------------------------
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No Dynamo-disabling wrapper around ``__torch_dispatch__`` (a few µs an op): Dynamo
        compiles no frame while a dispatch mode is on the stack anyway."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        entry = _ENTRIES.get(id(func))  # OpOverloads live forever; id() hashes fastest
        if entry is None:
            entry = _ENTRIES[id(func)] = _resolve(func)
            _OPS[id(func)] = func
        call, rule, mutated = entry.call, entry.rule, entry.mutated
        out = call(*args, **kwargs) if kwargs else call(*args)
        if entry.moves_views:
            LAYOUT_EPOCH[0] += 1
        if self._paused:
            return out
        if entry.broadcast and (entry.broadcast == "expand" or tensor_state.any_set(args, "broadcast")):
            record_broadcast(entry.broadcast, func, args, out)
        kwargs = kwargs or {}
        if rule is None:
            self.unknown[id(func)] += 1
            if self.sites is not None:
                self._count_site(func, args, out, typed=False)
            if mutated:
                self._forget(mutated, args, kwargs)
            elif isinstance(out, torch.Tensor) and out.numel() == 1 and self.types(out) is None:
                tensor_state.write(out, "untyped", self.key)
            return out
        branched = ()
        if entry.aten:  # axes_here's own first test, inline: a kept frame inside its branch
            for kept, start, end in self.branches.spans:
                if start < kept.f_lasti < end:
                    branched = self.branches.axes_here()
                    break
        sig = None
        if entry.memo and not (self.rank_scalars or self.accumulating or branched):
            sig = op_memo.signature(id(func), self.key, args, kwargs)
            if sig is not None:
                try:
                    known = op_memo.OUTCOMES.get(sig)
                except TypeError:  # an unhashable argument
                    known = sig = None
                if known is not None:
                    return self._typed(func, args, kwargs, out, known[0], entry, branched, known[1])
                writes = tensor_state.WRITES[0]
        try:
            pl = rule(self, args, kwargs, out)
        except Violation as violation:
            sig = None
            if func.namespace == "_c10d_functional" and isinstance(out, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(out)  # raise with no work in flight
            empty = _holds_nothing(out)  # no element: no rule broken, and a write changes nothing
            if not empty and violation.axis not in branched:  # a rule's premise: every rank runs it
                self.report(violation, func, args)
            pl = NO_TENSOR if empty and mutated else _retyped_after(self, violation, rule, args, kwargs, out)
        if pl is NO_TENSOR:
            if func in _LANDS_ON_WAIT:
                tensor_state.write(args[0], "landing", True)
                self.landings[tuple(args[0].shape)] += 1
            self.typed += 1
            if self.sites is not None:
                self._count_site(func, args, out, typed=True)
            return out
        if pl is None:
            self.unknown[id(func)] += 1
            if self.sites is not None:
                self._count_site(func, args, out, typed=False, ruled=True)
            if mutated:
                self._forget(mutated, args, kwargs)
            else:
                self._type_outputs(out, None, NOTHING, None)
            return out
        if sig is not None and tensor_state.WRITES[0] != writes:
            sig = None  # the rule wrote a field: not an outcome of the signature alone
        return self._typed(func, args, kwargs, out, pl, entry, branched, None, sig)

    def _typed(self, func, args, kwargs, out, pl, entry: OpEntry, branched: tuple[int, ...],
               flags: Known | None = None, sig: tuple | None = None):
        """Type ``out`` (or the tensors an in-place op wrote) ``pl``, the rule's verdict, and
        what is known of its value (``flags``, else worked out, and with ``sig`` both kept as
        its outcome: see op_memo), after the rank's own numbers, accumulations and branches."""
        value_rule, mutated = entry.value_rule, entry.mutated
        if self.rank_scalars:
            pl = self._varied_by_scalars(pl, func, args, kwargs)
        if self.sites is None:
            self.typed += 1
        elif _knows_an_axis(pl):
            self.typed += 1
            self._count_site(func, args, out, typed=True)
        else:  # no axis known is no type (coverage by site asks): its origin is here
            self.unknown[id(func)] += 1
            self._count_site(func, args, out, typed=False, ruled=True)
        if flags is None:
            flags = (self._flags(args[0]) if value_rule is _KEEP else  # views, detach: the common case
                     self._value_flags(value_rule, func, args) if value_rule else NOTHING)
            if value_rule is _ADD:
                flags = self._accumulation(args, flags)
            if sig is not None:
                op_memo.keep(sig, pl, flags)
        if self.accumulating and flags not in WITH_ACC and entry.aten:
            pl = self._after_accumulation(pl, args)
        if branched:
            if flags == ACC:
                flags = Known.ACC | Known.ONE_RANK
                self.accumulating = True
            pl = self._after_rank_branch(pl, args, flags, branched)
        if mutated:
            for t in _mutated_tensors(mutated, args, kwargs):
                self.update_inplace(t, pl, None, flags)
        elif isinstance(out, torch.Tensor):  # _type_outputs' common case
            self.type_result(out, pl, flags, args[0] if entry.is_view else None)
        else:
            self._type_outputs(out, pl, flags, args[0] if entry.is_view else None)
        return out

    def _count_site(self, func, args, out, typed: bool, ruled: bool = False) -> None:
        """Per source location: op calls typed and unknown. An unknown result remembers where
        its unknown was made and why (:mod:`unknown_origins`): the first op that gave no type
        from inputs with no origin, found by following unknown inputs back (``origins``, by
        origin and the location of each op call it reached; ``ruled``: a rule ran and gave no
        type). Ops torch.distributed makes to carry out a collective (the collective itself is
        typed) are not the caller's: an unknown they make begins at the line that called it."""
        location = op_site()
        name = _ENTRIES[id(func)].name
        if location is None:
            if not typed:
                self._origin(func, name, args, out, ruled, user_location())
            return
        if name in _LANDING_NAMES and self._landing(name, args, out):
            return
        site = self.sites.get(location)
        if site is None:
            site = self.sites[location] = [0, 0]
        site[0 if typed else 1] += 1
        if not typed:
            self.origins[self._origin(func, name, args, out, ruled, location), location] += 1

    def _origin(self, func, name: str, args, out, ruled: bool, location: str) -> str:
        """Where the unknown ``out`` began (an unknown input's origin, else this op at
        ``location`` with its cause), remembered on ``out`` and on what a c10d collective
        writes, its first argument (``all_to_all_single``'s output: the op returns its work)."""
        origin = next((tensor_state.read(t, "origin") for t in _flat(args)
                       if isinstance(t, torch.Tensor) and self.types(t) is None
                       and tensor_state.read(t, "origin") is not None), None)
        if origin is None:
            origin = f"{location} {name}: {unknown_origins.cause(self, func, args, ruled, location)}"
        written = args[:1] if func.namespace == "c10d" else ()
        for t in _flat((out, *written)):
            if isinstance(t, torch.Tensor):
                tensor_state.write(t, "origin", origin)
        return origin

    def _landing(self, name: str, args, out) -> bool:
        """Whether the op (of :func:`base_name` ``name``) is Gloo landing an async collective
        when it is waited on: cutting its reduced buffer (one the checker never saw) and copying
        this rank's piece into the output. Both are the collective's own ops, typed by it."""
        if name == "copy":
            return bool(tensor_state.read(args[0], "landing"))
        return (name == "split" and isinstance(out, (tuple, list)) and bool(out)
                and self.landings[tuple(out[0].shape)] > 0
                and self.types(args[0]) is None and tensor_state.read(args[0], "origin") is None)

    def _forget(self, mutated, args, kwargs) -> None:
        """An untyped write makes its target unknown, except a collective's own copies (made
        inside torch.distributed, or the copy an async collective makes when waited on)."""
        for t in _mutated_tensors(mutated, args, kwargs):
            if self.types(t) is None:
                continue
            if tensor_state.read(t, "landing"):
                tensor_state.write(t, "landing", False)
                self.landings[tuple(t.shape)] -= 1
            elif not inside_collective():
                self.update_inplace(t, None)

    def _type_outputs(self, out, pl, flags: Known, base: torch.Tensor | None) -> None:
        if isinstance(out, torch.Tensor):
            self.type_result(out, pl, flags, base)
            return
        if not isinstance(out, (tuple, list)):
            return
        each = pl if isinstance(pl, list) else [pl] * len(out)
        for t, p in zip(out, each, strict=False):
            if isinstance(t, torch.Tensor):
                self.type_result(t, p, flags, base)

    def _accumulation(self, args, flags: Known) -> Known:
        """zeros + x (in place or not), x a value of its own: ACC."""
        if (len(args) >= 2 and isinstance(args[1], torch.Tensor) and self.zero(args[0])
                and not self.zero(args[1])):
            return ACC
        return flags

    def _value_flags(self, kind: ValueRule, func, args) -> Known:
        if kind is _ARITH or kind is _ADD:
            for a in args:
                if isinstance(a, torch.Tensor) and not self.const(a):
                    return NOTHING
            return CONST
        if kind is _KEEP:
            return self._flags(args[0])
        if kind is ValueRule.JOIN:
            return _joined_flags({self._flags(t) for t in args[0]})
        if kind is ValueRule.ZERO:
            return ZERO
        if kind is ValueRule.COPY:
            return self._flags(args[1])
        if kind is ValueRule.LIFT:
            if args[0].numel() != 1:
                return Known.NOTHING
            return Known.ZERO if args[0].item() == 0 else Known.CONST
        pos = FILL_VALUE_POS.get(base_name(func))
        value = args[pos] if pos is not None and len(args) > pos else None
        return Known.ZERO if isinstance(value, (int, float)) and value == 0 else Known.CONST

    # --- violations --------------------------------------------------------------------
    def report(self, violation: Violation, func, args) -> None:
        """Raise ``violation`` of ``func`` on ``args`` (mode "raise"), or record it."""
        node = engine_node()
        location = violation_site(node)
        if self.mode == "raise" and not violation.unconfirmed:
            raise SpmdTypeError(self.describe(violation, location, func, args), violation.rule,
                                location, str(func))
        if (location, violation.rule) not in self._seen:  # a message for the first one only
            self._seen.add((location, violation.rule))
            axis = violation.axis
            self.records.append(ViolationRecord(
                violation.rule, location, str(func), self.describe(violation, location, func, args),
                self.names[axis] if axis >= 0 else None, self.index[axis] if axis >= 0 else None,
                violation.occurrence, node.name() if node is not None else "", self._partial(axis, args)))

    def _partial(self, axis: int, args: tuple) -> tuple[int, ...]:
        """The tensor operands (by their index among the op's tensors) that are partial sums on ``axis``."""
        tensors = [x for x in _flat(args) if isinstance(x, torch.Tensor)]
        return tuple(i for i, t in enumerate(tensors)
                     if axis >= 0 and is_partial((self.types(t) or (None,) * len(self.names))[axis]))

    def describe(self, violation: Violation, location: str, op: Any, args: tuple) -> str:
        numbers = getattr(op, "namespace", "") == "aten"
        operands = [x for x in _flat(args) if isinstance(x, torch.Tensor)
                    or (numbers and isinstance(x, (int, float)) and not isinstance(x, bool))]
        summary = ", ".join(self.render(x) for x in operands)
        axis = self.names[violation.axis] if violation.axis >= 0 else "?"
        why, fix = HELP.get(violation.rule, ("", ""))
        short = getattr(op, "_opname", str(op))
        lines = [f"checker: {violation.rule} at {location} in {op}: {summary}"]
        lines += [f"  operand {i}: {self.render(x)} shape {tuple(x.shape)}"
                  for i, x in enumerate(operands) if isinstance(x, torch.Tensor)]
        if violation.axis >= 0:
            lines.append(f"  axis: {axis} (ranks {list(self.mesh.axes[axis].ranks)})")
        if violation.why:
            lines.append(f"  {violation.why}")
        lines.append(f"  why: {why}")
        lines.append("  fix: " + fix.format(axis=axis, op=short))
        return "\n".join(lines)

    def render(self, x: Any) -> str:
        if not isinstance(x, torch.Tensor):
            return repr(x)
        pl = self.types(x)
        if pl is None:
            return "?"
        known = {Known.CONST: " const", Known.ZERO: " zero", Known.ACC: " accumulated"}.get(
            self._flags(x) & ~Known.ONE_RANK, "")
        inner = ", ".join(f"{n}:{'?' if p is None else p}"
                          for n, p in zip(self.names, pl, strict=True))
        return "{" + inner + "}" + known

    # --- region ------------------------------------------------------------------------
    @contextmanager
    def paused(self) -> Iterator[None]:
        """Run ops untyped (inside contracts and typed helpers)."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    def coverage(self, top: int = 10) -> Coverage:
        names = Counter()
        for key, count in self.unknown.items():
            names[str(_OPS[key])] += count
        by_site = sorted(((loc, t, u) for loc, (t, u) in (self.sites or {}).items()), key=lambda x: -x[2])
        origins = Counter()
        for (origin, _), calls in self.origins.items():
            origins[origin] += calls
        return Coverage(self.typed, sum(self.unknown.values()), names.most_common(top),
                        by_site, origins.most_common(top),
                        [(origin, loc, calls) for (origin, loc), calls in self.origins.items()])

    def summary(self) -> str:
        if not self.records:
            return "shardcheck: no SPMD type violations"
        lines = [f"shardcheck: {len(self.records)} SPMD type violation(s)"]
        lines += [r.first_line for r in self.records]
        return "\n".join(lines)


class _VaryingOn:
    """The checker as a rule re-run after a violation sees it: every operand V on one axis.
    ``rerun`` tells a rule that it ran on these operands already (its reports are made and its
    exchanges with the other ranks done)."""

    rerun = True

    def __init__(self, checker: Checker, axis: int) -> None:
        self._checker, self._axis = checker, axis

    def __getattr__(self, name: str) -> Any:
        return getattr(self._checker, name)

    def types(self, t: Any) -> tuple | None:
        pl = self._checker.types(t)
        return None if pl is None else pl[:self._axis] + (V,) + pl[self._axis + 1:]

    def count_varying_cut(self) -> int:
        """The cut was numbered when the rule first ran (on every rank): the same number."""
        return self._checker.varying_cuts


def _retyped_after(checker: Checker, violation: Violation, rule, args, kwargs, out):
    """In collect mode, a violating op's result is V on the broken axis (its values differ per
    rank with no meaning the mesh knows), so checking goes on downstream, backward included."""
    if violation.axis < 0:
        return None
    try:
        return rule(_VaryingOn(checker, violation.axis), args, kwargs, out)
    except Violation:
        return None


def _joined_flags(kinds: set[Known]) -> Known:
    """What is known of pieces joined (cat, stack) whose own flags are ``kinds`` (constants of
    each its own are no constant)."""
    if kinds == {Known.ZERO}:
        return Known.ZERO
    added = {k for k in kinds if k & Known.ACC}
    return max(added) if added and kinds <= added | {Known.ZERO} else Known.NOTHING


def _flat(args: Any) -> Iterator[Any]:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _knows_an_axis(pl: Any) -> bool:
    """Whether a rule's verdict (a placement per axis, or a list of them, one per output)
    knows any axis of any output."""
    if isinstance(pl, list):
        return any(_knows_an_axis(p) for p in pl)
    return pl is not None and pl.count(None) != len(pl)


def _holds_nothing(out: Any) -> bool:
    """Whether an op's results have no element (an add into an empty view, say)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [t for t in outs if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.numel() == 0 for t in tensors)


def _mutated_tensors(mutated, args, kwargs) -> Iterator[torch.Tensor]:
    for pos, name in mutated:
        value = args[pos] if pos < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


@dataclass(frozen=True, slots=True)
class OpEntry:
    """What the dispatch needs of an op, resolved once per OpOverload (see :func:`_resolve`)."""

    call: Callable  # what runs it: a plain OpOverload's C++ op (``OpOverload.__call__`` is a
    # Python frame that only calls it)
    rule: Callable | None  # its typing rule (see rules.registry)
    value_rule: ValueRule | None  # how what is known of its result's value follows from its inputs'
    mutated: tuple[tuple[int, str], ...]  # the (position, name) of the args it writes
    is_view: bool  # its result aliases its first arg
    moves_views: bool  # an in-place view op (t_, resize_, set_, ...) or an out= op (resizes its output)
    broadcast: str  # what broadcast.record does for it (see broadcast.op_kind)
    aten: bool  # in the aten namespace
    name: str  # its base_name
    memo: bool  # its rule's outcomes may be remembered by signature (see op_memo)


def _resolve(func) -> OpEntry:
    """What the dispatch needs of ``func``."""
    rule, name = registry.rule_for(func), base_name(func)
    schema = func._schema
    mutated = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    is_view = (not mutated and bool(schema.returns) and schema.returns[0].alias_info is not None)
    if func.namespace == "c10d" and rule is None and schema.arguments:
        mutated = ((0, schema.arguments[0].name),)
    return OpEntry(
        call=func._op if type(func) is torch._ops.OpOverload else func, rule=rule,
        value_rule=registry.value_rule(name), mutated=mutated, is_view=is_view,
        moves_views=torch.Tag.inplace_view in func.tags or any(a.is_out for a in schema.arguments),
        broadcast=broadcast_kind(func), aten=func.namespace == "aten", name=name,
        memo=op_memo.memoised(func, rule))


# --- public API ------------------------------------------------------------------------------

def current() -> Checker | None:
    """The innermost active checker, or None outside ``typecheck``."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def typecheck(mesh: Mesh, mode: str = "raise", sites: bool = False) -> Iterator[Checker]:
    """Type-check every op in the region on ``mesh``; mode "raise" (default) or "collect".

    With ``sites``, :func:`coverage` also counts op calls per source location and traces each
    unknown value back to the op that made it (a few µs more per op).
    """
    checker = Checker(mesh, mode, sites)
    if not _ACTIVE:
        unseen.install(_varying_everywhere, _layout_moved)
    _ACTIVE.append(checker)
    rank_branches.watch(checker.rank_read)
    try:
        with checker:
            yield checker
    finally:
        rank_branches.unwatch(checker.rank_read)
        checker.branches.clear()  # the frames hold their locals
        _ACTIVE.remove(checker)
        if not _ACTIVE:
            unseen.uninstall()
        _LAST[:] = [checker]
        if mode == "collect" and checker.records:  # silent when clean: parity runs many regions
            print(checker.summary(), file=sys.stderr, flush=True)


def _layout_moved() -> None:
    """A tensor now lies elsewhere (``t.data = value``): the cached storage spans are stale."""
    LAYOUT_EPOCH[0] += 1


def _varying_everywhere(t: torch.Tensor) -> torch.Tensor:
    checker = current()
    return t if checker is None else annotate(t, **{n: V for n in checker.names})


def _checker_for(mesh: Mesh | None) -> Checker:
    if mesh is not None:
        return Checker(mesh)
    checker = current()
    if checker is None:
        raise RuntimeError("shardcheck: call this inside `with sc.typecheck(mesh):` or pass mesh=")
    return checker


def _placement(value: Placement | str) -> Placement:
    return value if isinstance(value, Placement) else parse_placement(str(value))


def annotate(x: torch.Tensor, mesh: Mesh | None = None, **placements: Placement | str) -> torch.Tensor:
    """Declare ``x``'s placement on the named axes (others keep their type); returns ``x``."""
    checker = _checker_for(mesh)
    unknown = set(placements) - set(checker.names)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; the mesh has {list(checker.names)}")
    old = checker.types(x) or (None,) * checker.n
    pl = tuple(_placement(placements[n]) if n in placements else old[i]
               for i, n in enumerate(checker.names))
    checker.set_type(x, pl, checker._flags(x))
    if x._base is not None:
        checker.register_view(x, x._base)
    return x


def typeof(x: torch.Tensor, mesh: Mesh | None = None) -> dict[str, Placement]:
    """The known placements of ``x`` by axis name (unknown axes are left out)."""
    checker = _checker_for(mesh)
    pl = checker.types(x) or ()
    return {n: p for n, p in zip(checker.names, pl, strict=False) if p is not None}


def _same(actual: Placement | None, expected: Placement, ndim: int) -> bool:
    if isinstance(expected, Shard) and isinstance(actual, Shard):
        return expected.dim % max(ndim, 1) == actual.dim % max(ndim, 1)
    return actual is expected or actual == expected


def assert_type(x: torch.Tensor, **expected: Placement | str) -> None:
    """Raise SpmdTypeError (rule "assertion") unless ``x`` has the expected placements."""
    checker = _checker_for(None)
    actual = typeof(x)
    wrong = {n: p for n, p in expected.items()
             if not _same(actual.get(n), _placement(p), x.dim())}
    if wrong:
        location = user_location()
        want = ", ".join(f"{n}={_placement(p)}" for n, p in wrong.items())
        got = ", ".join(f"{n}={actual.get(n, '?')}" for n in wrong)
        message = (f"checker: assertion at {location} in assert_type: expected {want}, got {got}\n"
                   f"  value: {checker.render(x)} shape {tuple(x.shape)}")
        raise SpmdTypeError(message, "assertion", location, "assert_type")


def violations() -> list[ViolationRecord]:
    """Violations recorded by the active (or the last) typecheck region in collect mode."""
    checker = current() or (_LAST[0] if _LAST else None)
    return list(checker.records) if checker else []


def coverage(top: int = 10) -> Coverage:
    """Typed vs unknown op calls of the active (or the last) typecheck region."""
    checker = current() or (_LAST[0] if _LAST else None)
    return checker.coverage(top) if checker else Coverage()


def rank_slice(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` for ``axis``: R there becomes S(dim)."""
    checker = _checker_for(None)
    a = checker.names.index(axis)
    size, index = checker.sizes[a], checker.index[a]
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split into {size} chunks")
    pl = checker.types(x) or (None,) * checker.n
    if pl[a] is not None and not replicated(pl[a]):
        checker.report(Violation("split of varying", a), torch.ops.aten.slice.Tensor, (x,))
    length = x.shape[dim] // size
    with checker.paused():
        piece = x.narrow(dim, index * length, length)
    checker.set_type(piece, pl[:a] + (S(dim % x.dim()),) + pl[a + 1:], checker._flags(x))
    return piece


def contract(args: Mapping[int | str, Mapping[str, Placement | str]] | None = None,
             returns: Mapping[str, Placement | str] | list | None = None,
             trusted: bool = True) -> Callable[[Callable], Callable]:
    """Decorate a function with argument types checked on entry and result types set on exit.

    ``args`` maps a positional index or keyword name to {axis: placement}; a placement
    "A|B" accepts either, and a required V also a partial count (its pieces stacked, as a
    gather of per-rank values does: see :func:`rules.stacks_as_pieces`). With ``trusted``,
    the body runs untyped (its ops are not checked); ``returns`` types the result (a list
    types each element of a tuple result).
    """
    def wrap(fn: Callable) -> Callable:
        def checked(*call_args, **call_kwargs):
            checker = current()
            if checker is None:
                return fn(*call_args, **call_kwargs)
            _check_args(checker, args or {}, call_args, call_kwargs)
            if trusted:
                with checker.paused():
                    result = fn(*call_args, **call_kwargs)
            else:
                result = fn(*call_args, **call_kwargs)
            _type_result(result, returns)
            return result
        checked.__wrapped__ = fn
        checked.__name__ = getattr(fn, "__name__", "contract")
        checked.__doc__ = fn.__doc__
        return checked
    return wrap


def _check_args(checker: Checker, spec, call_args, call_kwargs) -> None:
    for key, expected in spec.items():
        value = call_args[key] if isinstance(key, int) else call_kwargs.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        actual = typeof(value)
        for axis, want in expected.items():
            got = actual.get(axis)
            accepted = _alternatives(want)
            if got is not None and not any(_admits(alt, got, value) for alt in accepted):
                wanted = "|".join(map(repr, accepted))
                checker.report(Violation("contract", checker.names.index(axis),
                                         f"argument {key} must be {axis}={wanted}"),
                               "contract", (value,))


def _alternatives(want: Placement | str) -> tuple[Placement, ...]:
    return (want,) if isinstance(want, Placement) else parse_alternatives(str(want))


def _admits(want: Placement, got: Placement, value: torch.Tensor) -> bool:
    """``got`` meets ``want``; a required V (per-rank values) also admits a partial count."""
    return _same(got, want, value.dim()) or (want is V and stacks_as_pieces(got, value))


def _type_result(result: Any, returns) -> None:
    if returns is None:
        return
    if isinstance(returns, list):
        for value, spec in zip(result, returns, strict=False):
            if isinstance(value, torch.Tensor) and spec is not None:
                annotate(value, **spec)
    elif isinstance(result, torch.Tensor):
        annotate(result, **returns)
