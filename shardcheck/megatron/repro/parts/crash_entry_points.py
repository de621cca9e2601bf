"""A one-rank crash's runs: observed, the component with the finding's options on one rank,
which megatron-core's own code breaks off; reference, a run that returns."""

from __future__ import annotations

import traceback

import torch

from shardcheck.megatron.repro.parts.base import run_on
from shardcheck.megatron.repro.parts.script import ONE_RANK, RAISED


def observed():
    """1 when the run raises the recorded exception in the recorded megatron-core file, else 0."""
    try:
        run_on(ONE_RANK)
    except Exception as exc:  # noqa: BLE001 - the crash is what the script shows
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/core/" in f.filename]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "outside megatron-core"
        print(f"raised: {type(exc).__name__}: {exc}\n    at {where}")
        return torch.tensor([float(type(exc).__name__ == RAISED[0] and RAISED[1] in where)])
    return torch.zeros(1)


def reference():
    """A run that raises nothing."""
    return torch.zeros(1)
