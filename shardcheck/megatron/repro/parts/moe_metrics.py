"""The MoE metrics megatron's training loop logs, for a script whose model has experts."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_utils


def moe_metrics(config, num_microbatches, pg):
    """The MoE metrics (load-balancing and z losses) as megatron's training loop logs them after a step
    (``track_moe_metrics``), in name order; the names any pipeline stage recorded."""
    names, logged = [None] * pg.pp.size(), {}
    dist.all_gather_object(names, sorted(moe_utils.get_moe_layer_wise_logging_tracker()), group=pg.pp)

    class Writer:  # a tensorboard writer's add_scalar
        def add_scalar(self, name, value, _iteration):
            logged[name] = float(value)

    moe_utils.track_moe_metrics(1.0 / num_microbatches, 0, Writer(), force_initialize=True,
                                track_names=sorted(set().union(*names)), num_layers=config.num_layers,
                                moe_layer_freq=config.moe_layer_freq, mtp_num_layers=config.mtp_num_layers,
                                pg_collection=pg)
    return torch.tensor([logged[name] for name in sorted(logged)])
