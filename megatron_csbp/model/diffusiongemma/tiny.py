"""Tiny random-weight DiffusionGemma models for tests and CPU recipes (no download).

`tiny_hf_model` builds a Hugging Face `DiffusionGemmaForBlockDiffusion` (needs transformers) with
every weight random, norm weights and router scales near 1, and different encoder / decoder
`layer_scalar` buffers, so that a wiring error anywhere shows up in the logits.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_csbp.model.diffusiongemma.config import FULL, SLIDING, make_config

TINY_LAYER_TYPES = (SLIDING, FULL, SLIDING, FULL)


def tiny_text_config(vocab_size: int = 96, sliding_window: int = 6, layer_types: Sequence[str] = TINY_LAYER_TYPES,
                     hidden_size: int = 32, num_experts: int = 4, top_k: int = 2) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=48, num_hidden_layers=len(layer_types),
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                num_global_key_value_heads=1, layer_types=list(layer_types), sliding_window=sliding_window,
                num_experts=num_experts, top_k_experts=top_k, moe_intermediate_size=12, max_position_embeddings=256)


def tiny_hf_config(**text_kwargs):
    from transformers import DiffusionGemmaConfig

    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    cfg = DiffusionGemmaConfig(text_config=tiny_text_config(**text_kwargs), vision_config=vision, canvas_length=4)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_hf_model(seed: int = 0, dtype: torch.dtype = torch.float32, **text_kwargs):
    from transformers import DiffusionGemmaForBlockDiffusion

    cfg = tiny_hf_config(**text_kwargs)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model.to(dtype)


def tiny_megatron_config(vocab_size: Optional[int] = None, sliding_window: int = 6,
                         layer_types: Sequence[str] = TINY_LAYER_TYPES, **overrides):
    """The Megatron config of `tiny_hf_model` (without transformers)."""
    kw = dict(num_layers=len(layer_types), hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
              num_query_groups=2, kv_channels=8, layer_types=list(layer_types), sliding_window=sliding_window,
              full_kv_channels=16, full_num_query_groups=1, num_moe_experts=4, moe_router_topk=2,
              moe_ffn_hidden_size=12)
    kw.update(overrides)
    return make_config(**kw)
