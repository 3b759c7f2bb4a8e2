"""DiffusionGemma as a registered model family, so the converter, `convert score` and the trainer
treat it like the Llama / Qwen families: `shape_from_hf_config` -> `megatron_csbp_model.json` ->
`megatron_csbp.model.builder.build_gpt_model`. Sources: `diffusion_gemma` checkpoints (full layers
always K=V) and Gemma 4 text MoE checkpoints (AR starting points). The shape keeps `hf_config`
(docs/conversion.md#checkpoint-format-what-the-trainer---loads, docs/diffusiongemma.md).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from megatron_csbp.model.families import register_family
from megatron_csbp.model.families.base import Family, ModelShape, UnsupportedModelError, check_dtype

# The model's modules (megatron_csbp.model.diffusiongemma) are imported where used: importing the
# registry stays light, and model/diffusiongemma/ never imports the families.

FAMILY = "diffusion_gemma"
#: Hugging Face model types read as DiffusionGemma
SOURCE_TYPES = ("diffusion_gemma", "gemma4", "gemma4_text")
#: DiffusionGemma's fixed final soft-cap (the HF model has no config field for it)
DIFFUSION_GEMMA_SOFTCAP = 30.0


def shape_from_hf_config(cfg: Dict[str, Any], params_dtype: Optional[str] = None) -> ModelShape:
    """The shape of a `diffusion_gemma` or Gemma 4 text MoE config; refuses what the Megatron model
    cannot reproduce (the message names the option)."""
    from megatron_csbp.model.core import dimensions
    from megatron_csbp.model.diffusiongemma.config import UnsupportedDiffusionGemmaConfig, text_config_dict

    source, text = cfg.get("model_type"), text_config_dict(cfg)
    if source == "diffusion_gemma":
        options = dict(source=source, k_eq_v_full=True, final_logit_softcapping=DIFFUSION_GEMMA_SOFTCAP)
    elif not text.get("enable_moe_block", False):
        raise UnsupportedModelError("Gemma 4 checkpoint without the MoE block (enable_moe_block=False) is not "
                                    "supported: DiffusionGemma layers are dense MLP + experts")
    else:
        options = dict(source=source, k_eq_v_full=bool(text.get("attention_k_eq_v", False)),
                       final_logit_softcapping=text.get("final_logit_softcapping"))
    try:
        config = megatron_config_from(cfg, options, torch.float32)
    except UnsupportedDiffusionGemmaConfig as exc:
        raise UnsupportedModelError(f"{source}: {exc}") from exc
    dtype = check_dtype(params_dtype or cfg.get("dtype") or text.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return ModelShape(
        family=FAMILY,
        **dict(dimensions(config), kv_channels=config.sliding_kv_channels),  # the sliding layers' head dim
        vocab_size=int(text["vocab_size"]), max_position_embeddings=int(text.get("max_position_embeddings") or 4096),
        norm_epsilon=config.layernorm_epsilon, rotary_base=config.rotary_base, qk_layernorm=True,
        tie_word_embeddings=True, num_experts=config.num_moe_experts, moe_router_topk=config.moe_router_topk,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size, params_dtype=dtype, hf_config=dict(cfg),
        diffusion_gemma=options,
    )


def megatron_config_from(hf_config: Dict[str, Any], options: Dict[str, Any], params_dtype: torch.dtype,
                         **overrides):
    from megatron_csbp.model.diffusiongemma.config import config_from_hf

    return config_from_hf(hf_config, params_dtype=params_dtype, k_eq_v_full=options["k_eq_v_full"],
                          final_logit_softcapping=options["final_logit_softcapping"], **overrides)


def transformer_config(shape: ModelShape, params_dtype: Optional[torch.dtype] = None, **overrides):
    """The `DiffusionGemmaConfig` of `shape`; `overrides` set parallelism and training options.
    Weights are not drawn unless `perform_initialization=True` (they are about to be loaded)."""
    dtype = params_dtype or shape.torch_dtype
    overrides.setdefault("perform_initialization", False)
    overrides.setdefault("pipeline_dtype", dtype)
    return megatron_config_from(shape.hf_config, shape.diffusion_gemma, dtype, **overrides)


def build_model(shape: ModelShape, config, block_diffusion: bool = True, kernel: str = "auto", stage=None):
    """A `DiffusionGemmaModel` of `shape` under the current parallel state (exact vocabulary);
    `kernel`: the block-diffusion attention kernel (--attention-kernel); `stage`: its pipeline chunk."""
    from megatron_csbp.model.diffusiongemma.model import diffusion_gemma_model

    return diffusion_gemma_model(config, shape.vocab_size, shape.max_position_embeddings,
                                 block_diffusion=block_diffusion, kernel=kernel, stage=stage)


def hf_config_for_export(shape: ModelShape) -> Dict[str, Any]:
    """The `diffusion_gemma` config.json of the model: the source's own, or for a Gemma 4 start one
    built with transformers' `DiffusionGemmaConfig` from the Gemma 4 text config."""
    cfg = shape.hf_config
    if shape.diffusion_gemma["source"] == "diffusion_gemma":
        return dict(cfg)
    opts = shape.diffusion_gemma
    if not opts["k_eq_v_full"]:
        raise UnsupportedModelError(
            "this model started from a Gemma 4 checkpoint with attention_k_eq_v=False: its full layers have a "
            "v_proj, which Hugging Face diffusion_gemma (always K=V) cannot hold")
    if opts["final_logit_softcapping"] != DIFFUSION_GEMMA_SOFTCAP:
        raise UnsupportedModelError(f"final_logit_softcapping {opts['final_logit_softcapping']}: Hugging Face "
                                    f"diffusion_gemma fixes it at {DIFFUSION_GEMMA_SOFTCAP}")
    from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig  # transformers >= 5.24 (setup.py)

    from megatron_csbp.model.diffusiongemma.config import text_config_dict

    text = text_config_dict(cfg)
    keys = set(DiffusionGemmaTextConfig().to_dict())
    text = {k: v for k, v in text.items() if k in keys and k not in ("model_type", "architectures")}
    text["per_layer_config"] = {str(k): v for k, v in text["per_layer_config"].items()}
    vision = cfg.get("vision_config") if isinstance(cfg.get("vision_config"), dict) else None
    out = DiffusionGemmaConfig(text_config=text, vision_config=vision).to_dict()
    out["architectures"] = ["DiffusionGemmaForBlockDiffusion"]
    return out


class DiffusionGemmaFamily(Family):
    """DiffusionGemma / Gemma 4 text MoE: `DiffusionGemmaConfig` and `DiffusionGemmaModel`, weights
    mapped by `megatron_csbp.model.families.diffusion_gemma_weights`."""

    name = FAMILY
    model_types = SOURCE_TYPES
    #: its clean stream is token-causal
    clean_attention = "token_causal"
    #: a diffusion_gemma checkpoint's vision tower is carried through conversion unchanged
    carries_extra_weights = True
    trainer_trains_moe = True

    shape_from_hf_config = staticmethod(shape_from_hf_config)
    transformer_config = staticmethod(transformer_config)
    build_model = staticmethod(build_model)

    def megatron_flags(self, shape):
        raise UnsupportedModelError("DiffusionGemma has no Megatron-LM flag set (heterogeneous layers, K=V full "
                                    "layers, sandwich norms): build it with megatron_csbp.model.builder.build_gpt_model"
                                    " or train it with python -m megatron_csbp.train --load CHECKPOINT")

    def hf_to_megatron(self, shape, tensors, cfg):
        from megatron_csbp.model.families import diffusion_gemma_weights as dg

        if shape.diffusion_gemma["source"] == "diffusion_gemma":
            state, _, rest = dg.hf_to_megatron_state(tensors, cfg)
            return state, rest
        # Gemma 4 start: its vision / audio towers have no place in a diffusion_gemma export.
        state, _, _ = dg.gemma4_to_megatron_state(tensors, cfg)
        return state, {}

    def megatron_to_hf(self, shape, state):
        from megatron_csbp.model.families.diffusion_gemma_weights import megatron_to_hf_state

        cfg = hf_config_for_export(shape)  # refuses a model Hugging Face cannot hold, before writing
        tensors = megatron_to_hf_state(state, transformer_config(shape))
        # A Gemma 4 start's generation defaults are an AR model's; diffusion_gemma refuses them.
        skip_assets = () if shape.diffusion_gemma["source"] == "diffusion_gemma" else ("generation_config.json",)
        return cfg, tensors, skip_assets


register_family(DiffusionGemmaFamily())
