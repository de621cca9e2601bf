"""Running megatron-core on a CPU: patches, plain-torch kernels, CP attention, parallel state and rank spawning."""

from collections.abc import Sequence

# What every megatron-core rank imports: a rank forked from an interpreter that imported these
# once (shardcheck.parity.forkserver) skips the seconds a fresh interpreter spends on them.
MEGATRON_PRELOAD = ("torch", "megatron.core.tensor_parallel", "megatron.core.models.gpt", "megatron.core.optimizer",
                    "megatron.core.distributed", "megatron.core.pipeline_parallel.schedules",
                    "megatron.core.datasets.gpt_dataset")
# Imported first, it installs Transformer Engine's CPU layer: megatron-core decides whether it
# has TE when each of its modules is first imported, so a server that preloads megatron-core for
# TE ranks must install TE before it.
TE_PRELOAD = "shardcheck.megatron.cpu.te.install_on_import"


def asks_for_transformer_engine(tokens: Sequence[str]) -> bool:
    """Whether Megatron flags (as ``shardcheck train`` passes them: flag, then its values)
    say ``--transformer-impl transformer_engine`` (the last one given, as Megatron reads them)."""
    tokens = list(tokens)
    given = [tokens[i + 1:i + 2] for i, token in enumerate(tokens) if token == "--transformer-impl"]
    return bool(given) and given[-1] == ["transformer_engine"]


def megatron_preload(tokens: Sequence[str], cpu: bool = True) -> tuple[str, ...]:
    """The modules a fork server imports for CPU ranks run with Megatron flags ``tokens``:
    :data:`MEGATRON_PRELOAD`, after Transformer Engine's CPU layer where they ask for TE."""
    if cpu and asks_for_transformer_engine(tokens):
        return (TE_PRELOAD, *MEGATRON_PRELOAD)
    return MEGATRON_PRELOAD
