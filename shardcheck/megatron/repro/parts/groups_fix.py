"""The fix of a global-group finding: parallel_state on the model's groups."""

from __future__ import annotations

import sys

FIXED = "--fixed" in sys.argv[1:]  # run everything with the fix: parallel_state on the model's groups


def with_fix(sizes, on):
    """``sizes``; when ``on``, with parallel_state's global groups those the model is given, so
    code that reads the globals instead of the model's pg_collection gets the right ones."""
    return {**sizes, "order": sizes["model_order"]} if on else sizes
