"""DiffusionGemma (Gemma-4-style MoE block-diffusion LM) built from megatron-core modules."""
from megatron_csbp.model.diffusiongemma.config import (FULL, SLIDING, DiffusionGemmaConfig,
                                                       UnsupportedDiffusionGemmaConfig, config_from_hf, make_config)
from megatron_csbp.model.diffusiongemma.layer import (DiffusionGemmaTransformerLayer, diffusion_gemma_block_spec,
                                                      diffusion_gemma_layer_spec)
from megatron_csbp.model.diffusiongemma.model import DiffusionGemmaModel, diffusion_gemma_model

__all__ = [
    "FULL", "SLIDING", "DiffusionGemmaConfig", "UnsupportedDiffusionGemmaConfig", "config_from_hf", "make_config",
    "DiffusionGemmaTransformerLayer", "diffusion_gemma_block_spec", "diffusion_gemma_layer_spec",
    "DiffusionGemmaModel", "diffusion_gemma_model",
]
