"""SPMD type checking: placements, rule tables, collectives, the dispatch mode, gradient types and norm accounting."""
