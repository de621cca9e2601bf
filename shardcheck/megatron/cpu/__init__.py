"""Running megatron-core on a CPU: patches, plain-torch kernels, CP attention, parallel state and rank spawning."""
