"""Gradient-norm accounting: every logical parameter element counted exactly once.

The usual global-norm code squares each gradient, skips the duplicates (replicated parameters
on all but one model-parallel rank), sums, and all-reduces over the model-parallel group. The
checker tags each tensor derived from a gradient with the parameters it counts; at the
all-reduce the ranks exchange their tags and this module checks the counts:

- a parameter whose gradient is sharded (or differs per rank) on an axis must be counted on
  every rank of that axis;
- a parameter whose gradient is replicated on an axis must be counted on exactly one of them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

NORM_ACCOUNTING = "norm accounting"


@dataclass(frozen=True)
class Counted:
    """What one rank contributed to a norm: its coordinates and each parameter's types.

    ``coords`` and each parameter's ``types`` are indexed like the reduced axes; a type is
    'R' when the gradient is replicated on that axis and anything else when it is not.
    """

    coords: tuple[int, ...]
    params: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class AccountingError:
    """A parameter counted a wrong number of times in a global gradient norm."""

    param: str
    axis: str
    message: str
    rule: str = NORM_ACCOUNTING
    why: str = ("each logical parameter element must enter the global norm exactly once; "
                "otherwise gradient clipping scales every gradient by a wrong factor")

    def describe(self) -> str:
        return self.message

    @property
    def fix(self) -> str:
        return (f"count {self.param} on every {self.axis} rank if it is sharded there, on one "
                f"{self.axis} rank if it is replicated (and declare its type to match)")


def accounting_errors(ranks: Sequence[Counted], axes: Sequence[str],
                      sizes: Sequence[int]) -> list[AccountingError]:
    """Check every parameter counted by any rank of the reducing group."""
    names = sorted({name for rank in ranks for name in rank.params})
    errors = []
    for name in names:
        types = next(rank.params[name] for rank in ranks if name in rank.params)
        error = _check_param(name, types, ranks, axes, sizes)
        if error is not None:
            errors.append(error)
    return errors


def _check_param(name: str, types: tuple[str, ...], ranks: Sequence[Counted],
                 axes: Sequence[str], sizes: Sequence[int]) -> AccountingError | None:
    keyed = [a for a, t in enumerate(types) if t != "R"]
    counts = Counter(tuple(r.coords[a] for a in keyed) for r in ranks if name in r.params)
    for key in itertools.product(*(range(sizes[a]) for a in keyed)):
        if counts[key] == 0:
            return _left_out(name, types, ranks, axes, keyed)
        if counts[key] > 1:
            return _counted_twice(name, types, ranks, axes, keyed, key)
    return None


def _ranks_on(axis_pos: int, ranks: Sequence[Counted], name: str) -> list[int]:
    return sorted(r.coords[axis_pos] for r in ranks if name in r.params)


def _left_out(name, types, ranks, axes, keyed) -> AccountingError:
    a = keyed[0] if keyed else 0
    counting = _ranks_on(a, ranks, name)
    where = f"only {axes[a]} ranks {counting} count it" if counting else "no rank counts it"
    return AccountingError(name, axes[a], f"{name}'s gradient is {types[a]} on {axes[a]}, but "
                           f"{where}: the rest of its elements are left out of the norm")


def _counted_twice(name, types, ranks, axes, keyed, key) -> AccountingError:
    same = [r for r in ranks if name in r.params and tuple(r.coords[k] for k in keyed) == key]
    a = next(a for a, t in enumerate(types) if t == "R" and len({r.coords[a] for r in same}) > 1)
    counting = sorted(r.coords[a] for r in same)
    return AccountingError(name, axes[a], f"{name}'s gradient is R on {axes[a]}, but {axes[a]} "
                           f"ranks {counting} all count it: it enters the norm "
                           f"{len(counting)} times")
