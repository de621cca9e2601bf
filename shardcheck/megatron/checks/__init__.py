"""Typing megatron-core's own code: parameter types from Megatron's metadata, checked regions, contracts, explicit groups."""
