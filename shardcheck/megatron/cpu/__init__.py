"""Running megatron-core on a CPU: patches, plain-torch kernels, CP attention, parallel state and rank spawning."""

# What every megatron-core rank imports: a rank forked from an interpreter that imported these
# once (shardcheck.parity.forkserver) skips the seconds a fresh interpreter spends on them.
MEGATRON_PRELOAD = ("torch", "megatron.core.tensor_parallel", "megatron.core.models.gpt", "megatron.core.optimizer",
                    "megatron.core.distributed", "megatron.core.pipeline_parallel.schedules",
                    "megatron.core.datasets.gpt_dataset")
