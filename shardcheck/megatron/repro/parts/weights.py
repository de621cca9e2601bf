"""Seeded global weights for any layout, and every global gradient's norm."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from shardcheck.megatron.repro.parts.script import OVERRIDES, SECTIONS, SETUP
from shardcheck.megatron.repro.parts.seeded import seeded


def load_weights(model, pg):
    """Seeded global weights, the same in every layout (an expert's by its global index); a
    sharded weight gives each rank its piece, cut on the dim where its shape is smaller, section
    by section when it is fused."""
    for local_name, param in model.named_parameters():
        name, group = global_name(local_name, pg)
        full = seeded(name, *FULL.setdefault(name, param.shape)) * 0.2
        dim = next((d for d, (a, b) in enumerate(zip(full.shape, param.shape, strict=True)) if a != b), None)
        if dim is not None:
            sections = next((s for key, s in SECTIONS.items() if name.endswith(key)), [full.shape[dim]])
            full = torch.cat([s.chunk(group.size(), dim)[group.rank()] for s in full.split(sections, dim)], dim)
        param.data.copy_(full)


def global_name(name, pg):
    """A parameter's name in the one-rank model (layer and expert indices count those of the pp
    and ep ranks before; MTP's layers follow the decoder's on the last stage, numbered on their
    own), and the group it is sharded over: tp, or expert tp for an expert."""
    for word, group, total in (("layers", pg.pp, SETUP.get("layers")),
                               ("local_experts", pg.ep, OVERRIDES.get("num_moe_experts"))):
        name = re.sub(rf"(?<!mtp\.)\b{word}\.(\d+)\.",  # MTP layers: all on the last stage
                      lambda m, word=word, group=group, total=total: f"{word}.{group.rank() * total // group.size() + int(m[1])}.", name)
    if SETUP.get("share_embeddings") and name == "output_layer.weight":  # the last stage's copy
        name = "embedding.word_embeddings.weight"
    return name, pg.expt_tp if "local_experts." in name else pg.tp


def grad_norms(model, pg, counted=None):
    """The norm of every parameter's global gradient, in the one-rank model's order: the squares
    of its shards summed, from the stage (and for an expert the ep rank) that holds it; with
    ``counted`` (the gradients megatron's norm counts), of what the norm counts of it."""
    squares = dict.fromkeys(FULL, torch.zeros(()))
    for local_name, param in model.named_parameters():
        name, group = global_name(local_name, pg)
        kept = counted is None or id(param.main_grad) in counted
        squares[name] = param.main_grad.float().pow(2).sum() * float(kept)
        if counted is not None or param.shape != FULL[name]:
            dist.all_reduce(squares[name], group=group)
    squares = torch.stack(list(squares.values()))
    expert = torch.tensor(["local_experts." in name for name in FULL])
    experts = squares * expert
    dist.all_reduce(experts, op=dist.ReduceOp.MAX, group=pg.ep)  # the other ep ranks hold 0
    squares = torch.where(expert, experts, squares)
    dist.all_reduce(squares, op=dist.ReduceOp.MAX, group=pg.pp)  # the other stages hold 0
    return squares.sqrt()


FULL = {}  # each parameter's global shape, from the reference run (it runs first)
