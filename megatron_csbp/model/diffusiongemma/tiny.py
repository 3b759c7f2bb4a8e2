"""Tiny random-weight DiffusionGemma models for tests and CPU recipes (no download).

`tiny_hf_model` builds a Hugging Face `DiffusionGemmaForBlockDiffusion` (needs transformers) with
every weight random, norm weights and router scales near 1, and different encoder / decoder
`layer_scalar` buffers, so that a wiring error anywhere shows up in the logits.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_csbp.model.diffusiongemma.config import FULL, SLIDING, config_from_hf

TINY_LAYER_TYPES = (SLIDING, FULL, SLIDING, FULL)


def tiny_text_config(vocab_size: int = 96, sliding_window: int = 6, layer_types: Sequence[str] = TINY_LAYER_TYPES,
                     hidden_size: int = 32, num_experts: int = 4, top_k: int = 2) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=48, num_hidden_layers=len(layer_types),
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                num_global_key_value_heads=1, layer_types=list(layer_types), sliding_window=sliding_window,
                num_experts=num_experts, top_k_experts=top_k, moe_intermediate_size=12, max_position_embeddings=256,
                # transformers' defaults, spelled out so that `config_from_hf` reads them without transformers
                rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1_000_000.0}})


def tiny_hf_config(**text_kwargs):
    from transformers import DiffusionGemmaConfig

    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    cfg = DiffusionGemmaConfig(text_config=tiny_text_config(**text_kwargs), vision_config=vision, canvas_length=4)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_hf_model(seed: int = 0, dtype: torch.dtype = torch.float32, redraw: bool = True, **text_kwargs):
    """`redraw=False` keeps transformers' own initialisation (a model to train rather than to test
    wiring with)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    cfg = tiny_hf_config(**text_kwargs)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    if redraw:
        redraw_weights(model, seed + 1)
    return model.to(dtype)


def redraw_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-draw every weight of a Hugging Face or Megatron DiffusionGemma for wiring tests: norm
    weights and scales around 1, everything else N(0, 0.15^2), `layer_scalar` buffers in [0.5, 1.5)
    (so that the two streams' copies differ), from one generator in parameter order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


def tiny_megatron_config(vocab_size: Optional[int] = None, sliding_window: int = 6,
                         layer_types: Sequence[str] = TINY_LAYER_TYPES, **overrides):
    """The Megatron config of `tiny_hf_model` (without transformers): its text config read by `config_from_hf`."""
    return config_from_hf(tiny_text_config(sliding_window=sliding_window, layer_types=layer_types), **overrides)


def main(argv=None) -> int:
    """`python -m megatron_csbp.model.diffusiongemma.tiny --output DIR`: write a tiny random-weight
    Hugging Face `diffusion_gemma` folder (sliding and full layers, 4 experts), e.g. for the CPU
    DiffusionGemma SFT recipe: convert it with `python -m megatron_csbp.convert hf-to-megatron`."""
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    import argparse

    p = argparse.ArgumentParser(prog="python -m megatron_csbp.model.diffusiongemma.tiny", description=main.__doc__)
    p.add_argument("--output", required=True)
    p.add_argument("--vocab-size", type=int, default=1024, help="default: the shipped tokenizer's 1024 pieces")
    p.add_argument("--sliding-window", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # transformers' initialisation (std 0.02): a model to train
    model = tiny_hf_model(seed=args.seed, vocab_size=args.vocab_size, sliding_window=args.sliding_window, redraw=False)
    model.save_pretrained(args.output)
    print(f"wrote a tiny diffusion_gemma ({sum(p.numel() for p in model.parameters())} parameters, vocabulary "
          f"{args.vocab_size}, layers {list(TINY_LAYER_TYPES)}) -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
