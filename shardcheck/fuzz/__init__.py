"""Fuzzing: search spaces, campaigns, trials, finding records and reproduction scripts."""
