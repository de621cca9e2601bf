"""The tokens, router and expert weights the MoE row tests route (float64, seeded)."""

import torch


def moe_values(tokens: int, hidden: int, experts: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=gen, dtype=torch.float64),
            torch.randn(hidden, experts, generator=gen, dtype=torch.float64),
            torch.randn(experts, hidden, hidden, generator=gen, dtype=torch.float64))
