"""The function caches of megatron-core and TE, emptied before each Megatron scenario.

A warm rank process runs scenario after scenario. A function under ``functools.lru_cache``
keeps what it returned in an earlier scenario: a tensor made in that scenario's type-checked
region has that region's types only, so in the next region, on another mesh, it is a tensor
made outside the region, of unknown type, and so is everything computed from it (GDN's head
permutation under context parallelism: at ``cp2-dp2@dp-cp`` after ``cp2-dp2`` the permuted
projection, and all after it, lost its type; 20.9% of the op calls typed instead of 99.4%).
Every such cache in the loaded modules of both packages, found by walking them (module-level
functions and the methods of their classes, through decorators that keep ``__wrapped__``), is
emptied, so it is filled in the scenario's own region, as in the process's first scenario.
TE's dict caches of tensors are listed in :data:`~shardcheck.megatron.cpu.te.CACHED_TENSORS`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from types import FunctionType, ModuleType
from typing import Any

PACKAGES = ("megatron.", "transformer_engine.")
_FOUND: list = [-1, []]  # (the number of loaded modules when last walked, the caches found)


def function_caches() -> list[Any]:
    """Every ``lru_cache`` wrapper in the loaded modules of :data:`PACKAGES` (walked again
    when more modules were loaded)."""
    if _FOUND[0] != len(sys.modules):
        found = {id(cache): cache for name, module in list(sys.modules.items())
                 if name.startswith(PACKAGES) and isinstance(module, ModuleType)
                 for cache in _caches_of(module)}
        _FOUND[:] = [len(sys.modules), list(found.values())]
    return _FOUND[1]


def forget_function_caches() -> None:
    """Empty every cache :func:`function_caches` finds."""
    for cache in function_caches():
        cache.cache_clear()


def _caches_of(module: ModuleType) -> Iterator[Any]:
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            yield from filter(None, map(_cache, list(vars(value).values())))
        elif (cache := _cache(value)) is not None:
            yield cache


def _cache(value: Any) -> Any:
    """The ``lru_cache`` wrapper ``value`` is or wraps (a static or class method's function
    included), else None."""
    if isinstance(value, staticmethod | classmethod):
        value = value.__func__
    for _ in range(8):  # a few decorators deep
        if isinstance(value, functools._lru_cache_wrapper):
            return value
        if not isinstance(value, FunctionType):
            return None
        value = getattr(value, "__wrapped__", None)
    return None
