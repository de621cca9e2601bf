"""The script's observed, reference and corrected runs, with the fix under --fixed."""

from __future__ import annotations

from shardcheck.megatron.repro.parts.base import run_on
from shardcheck.megatron.repro.parts.script import FIXED, ONE_RANK, SIZES, with_fix


def observed():
    return run_on(with_fix(SIZES, FIXED), check=True)


def reference():
    return run_on(with_fix(ONE_RANK, FIXED))


def corrected():
    return run_on(with_fix(SIZES, True))
