"""Cost model and layout planner for block-diffusion training (`python -m megatron_csbp.plan`)."""
