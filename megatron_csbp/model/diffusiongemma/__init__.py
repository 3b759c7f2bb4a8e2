"""DiffusionGemma (Gemma-4-style MoE block-diffusion LM) built from megatron-core modules."""
from megatron_csbp.model.diffusiongemma.config import FULL, SLIDING, config_from_hf
from megatron_csbp.model.diffusiongemma.model import diffusion_gemma_model

__all__ = ["FULL", "SLIDING", "config_from_hf", "diffusion_gemma_model"]
