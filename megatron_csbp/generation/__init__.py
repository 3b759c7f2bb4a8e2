"""Decoding from checkpoints: `kv_cache` (the clean-prefix K/V cache both samplers use), `bd3lm`
(BD3-LM block decoding with the confidence threshold of Fast-dLLM), `diffusion_gemma`
(transformers' DiffusionGemma sampler on the Megatron model). The CLI is `megatron_csbp.generate`."""
