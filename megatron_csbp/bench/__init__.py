"""CPU benchmark of the block-diffusion layouts (`python -m megatron_csbp.bench`)."""
