"""The process groups of a layout, the component's run on them, a CPU-runnable config."""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from shardcheck.megatron.repro.parts.script import OVERRIDES, SETUP, run


def run_on(sizes, check=False):
    """``run`` on megatron's process groups for ``sizes`` (data parallelism takes the rest of the
    world); with ``check``, under shardcheck's type checker when it is installed."""
    global CHECKER
    pg = process_groups(sizes)
    if check and CHECKER:
        try:  # optional, only for the checker: line
            from shardcheck.megatron.repro.check import checked_run
        except ImportError:
            CHECKER = None  # no checker here to confirm the line the audit recorded
        else:
            result, CHECKER = checked_run(run, sizes, pg, CHECKER)
            return result
    return run(sizes, pg)


def process_groups(sizes):
    """parallel_state's groups in rank order ``order``; returns the model's: those of ``model_order``."""
    collections = []
    for order in dict.fromkeys([sizes["model_order"], sizes["order"]]):  # the globals' order last
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(sizes["tp"], sizes["pp"], context_parallel_size=sizes["cp"],
                                     expert_model_parallel_size=sizes["ep"], expert_tensor_parallel_size=sizes["etp"],
                                     order=order, create_gloo_process_groups=False)
        collections.append(ProcessGroupCollection.use_mpu_process_groups())
    fields = sizes.get("model_groups")  # explicit groups: the collection as a user constructs it
    return ProcessGroupCollection(**{f: getattr(collections[0], f, None) for f in fields}) if fields else collections[0]


def config_for(sizes, **options):
    """A CPU-runnable (MLA) TransformerConfig for ``sizes`` with the component's and finding's options."""
    config_class = MLATransformerConfig if OVERRIDES.get("multi_latent_attention") else TransformerConfig
    return config_class(**{
        "num_layers": 1, "hidden_size": SETUP["hidden"], "num_attention_heads": 4,
        "use_cpu_initialization": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "tensor_model_parallel_size": sizes["tp"], "context_parallel_size": sizes["cp"],
        "pipeline_model_parallel_size": sizes["pp"], "expert_model_parallel_size": sizes["ep"],
        "expert_tensor_parallel_size": sizes["etp"], "sequence_parallel": sizes["sp"],
        "pipeline_dtype": torch.float32, "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False, "masked_softmax_fusion": False, "apply_rope_fusion": False,
        **options, **OVERRIDES})
