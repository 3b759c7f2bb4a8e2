"""Tiny random-weight Hugging Face models of each supported family, built locally with
transformers (no download): for the equivalence tests and the AR -> BDLM example.

Weights are re-drawn with unit-scale statistics (not the 0.02 initialiser) so that logits are
O(1) and a 1e-4 comparison actually constrains the conversion; norm weights are drawn around 1 and
biases around 0 so a transposed or misplaced tensor shows up.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch

_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, attention_dropout=0.0)

#: family -> (its transformers config class, its settings beside _COMMON)
_CONFIGS = {
    # rope_theta 1e6 with llama3 scaling: head_dim 8 puts one frequency in each scaling regime
    "llama": ("LlamaConfig", dict(max_position_embeddings=65536, rope_parameters={
        "rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),  # head_dim != hidden / heads, as in Qwen3
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # Hybrid: Gated DeltaNet, attention, GDN, attention (full_attention_interval 2); gated
    # attention with head_dim 16 and partial rotary 0.25 (4 rotated dims), (1 + w) norms.
    "qwen3_5": ("Qwen3_5TextConfig", dict(
        num_hidden_layers=4, head_dim=16, full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
}
FAMILIES = tuple(_CONFIGS)


def tiny_config(family: str, **overrides: Any):
    """A transformers config of `family` (GQA 4 query heads over 2 KV groups)."""
    import transformers

    if family not in _CONFIGS:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    cls, kw = _CONFIGS[family]
    return getattr(transformers, cls)(**{**copy.deepcopy({**_COMMON, **kw}), **overrides})


def tiny_model(family: str, seed: int = 0, **overrides: Any):
    """A random-weight transformers causal LM (fp32, eager attention)."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("norm.weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def save_tiny_model(family: str, path: str, seed: int = 0, **overrides: Any):
    model = tiny_model(family, seed, **overrides)
    model.save_pretrained(path)
    return model


def save_tiny_tokenizer(path: str, vocab_size: int = 384, mask_token: str = "<|mask|>"):
    """A Qwen2/Qwen3 byte-level BPE tokenizer (transformers' `Qwen2Tokenizer`, which Qwen3 uses) with
    `vocab_size` pieces trained locally on the shipped corpus, plus `mask_token` as a special token
    (Qwen3's own has none; a BDLM needs one). Saved as `tokenizer.json` + `tokenizer_config.json`
    beside a tiny model, so `convert hf-to-megatron` carries it into the checkpoint's hf_assets.
    Its EOS (the EOD id) is `<|endoftext|>`. A tiny model needs `vocab_size` >= len(tokenizer)."""
    from transformers import Qwen2Tokenizer

    from megatron_csbp.data.corpus import load_documents

    tok = Qwen2Tokenizer().train_new_from_iterator(load_documents(), vocab_size=vocab_size)
    if mask_token:
        tok.add_special_tokens({"mask_token": mask_token})
    tok.save_pretrained(path)
    return tok
