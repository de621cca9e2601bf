"""Parity: layouts, scenarios, launching ranks, the warm rank pool, rebuilding global values and tolerances."""
