"""The script's observed and reference runs."""

from __future__ import annotations

from shardcheck.megatron.repro.parts.base import run_on
from shardcheck.megatron.repro.parts.script import ONE_RANK, SIZES


def observed():
    return run_on(SIZES, check=True)


def reference():
    return run_on(ONE_RANK)
