"""The audit of megatron-core: the sweep, one case per rank, divergences, findings and fuzz targets."""
