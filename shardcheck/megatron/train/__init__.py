"""`shardcheck train` on megatron-core: Megatron's own flags, functional-test configs, the training patches, our GPT entry point, per-step records."""
