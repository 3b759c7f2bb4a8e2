"""`DiffusionGemmaConfig`: a megatron-core `TransformerConfig` that describes DiffusionGemma (and
the Gemma 4 text MoE decoder it shares its layers with).

Per-layer differences go through Megatron's own heterogeneous-layer hook: `heterogeneous_block_specs`
is set and `get_config_for_layer` returns, for full-attention layers, a copy of the config with the
global head dim (`kv_channels`) and KV-head count (`num_query_groups`). Sliding windows use
Megatron's `window_size` + per-layer `window_attn_skip_freq` list, which the block-diffusion core
attention reads per layer. What Megatron has no field for (two rotary tables, logit soft-cap,
self-conditioning, K=V full layers) lives in the extra fields below.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_csbp.model.core import PORTABLE_CONFIG, PORTABLE_MOE_CONFIG, dtype_fields, transformer_config

SLIDING = "sliding_attention"
FULL = "full_attention"

gelu_tanh = functools.partial(F.gelu, approximate="tanh")


@dataclass
class DiffusionGemmaConfig(TransformerConfig):
    """TransformerConfig plus the DiffusionGemma-specific fields.

    The base fields describe the sliding layers (`kv_channels`, `num_query_groups`,
    `rotary_base`); `full_*` fields describe the full-attention layers.
    """

    layer_types: List[str] = field(default_factory=list)
    #: sliding layers' rotary theta (all sliding head dims rotate)
    rotary_base: float = 10_000.0
    sliding_window: int = 1024
    full_kv_channels: Optional[int] = None
    full_num_query_groups: Optional[int] = None
    #: full layers have no v_proj: V = v_norm(k_proj x) (always true for DiffusionGemma)
    full_k_eq_v: bool = True
    sliding_k_eq_v: bool = False
    full_rotary_base: float = 1_000_000.0
    #: fraction of the full-layer head dim that rotates ("proportional" rope: the rest get inv_freq 0)
    full_rotary_proportion: float = 0.25
    full_rope_factor: float = 1.0
    sliding_rope_factor: float = 1.0
    final_logit_softcapping: Optional[float] = 30.0
    #: the decoder (noisy rows) has the self-conditioning block and the normalised canvas embedding
    self_conditioning: bool = True
    embedding_padding_idx: Optional[int] = 0

    def __post_init__(self):
        if not self.layer_types:
            raise ValueError("DiffusionGemmaConfig needs layer_types (one of 'sliding_attention'/'full_attention' per layer)")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad:
            raise ValueError(f"unknown layer types {bad}")
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        #: kept apart because full-layer configs overwrite kv_channels
        self.sliding_kv_channels = self.kv_channels
        if self.full_kv_channels is None:
            self.full_kv_channels = self.kv_channels
        if self.full_num_query_groups is None:
            self.full_num_query_groups = self.num_query_groups
        # Per-layer sliding windows through Megatron's own fields (keys q-W < k <= q).
        sliding = SLIDING in self.layer_types
        self.window_size = (self.sliding_window - 1, 0) if sliding else None
        self.window_attn_skip_freq = [int(t == SLIDING) for t in self.layer_types] if sliding else None
        self.heterogeneous_block_specs = True
        super().__post_init__()
        self.heterogeneous_block_specs = True

    def layer_type(self, layer_number: int) -> str:
        """Type of the 1-based global layer `layer_number`."""
        return self.layer_types[layer_number - 1]

    def get_config_for_layer(self, layer_number: int) -> TransformerConfig:
        """Megatron's heterogeneous hook: the config that builds layer `layer_number` (1-based)."""
        if not 1 <= layer_number <= self.num_layers:
            raise ValueError(f"layer {layer_number} outside [1, {self.num_layers}]")
        if self.layer_type(layer_number) != FULL:
            return self
        layer_config = copy.copy(self)
        layer_config.kv_channels = self.full_kv_channels
        layer_config.num_query_groups = self.full_num_query_groups
        return layer_config

    @property
    def rotary_half_dims(self):
        """(d_sliding / 2, d_full / 2): the two tables' widths in the combined rotary tensor."""
        return self.sliding_kv_channels // 2, self.full_kv_channels // 2

    def k_eq_v(self, layer_number: int) -> bool:
        return self.full_k_eq_v if self.layer_type(layer_number) == FULL else self.sliding_k_eq_v

    def rope_inv_freq(self, kind: str) -> torch.Tensor:
        """Inverse frequencies (fp32, head_dim / 2 entries) of the `kind` layers' rotary table.

        Sliding: theta^(-2i/d) over all d dims. Full ("proportional"): the first
        int(proportion * d // 2) entries theta^(-2i/d), zeros after, so the rotate-half covers all
        d dims and the tail pairs do not rotate."""
        d, base, factor, proportion = {
            SLIDING: (self.sliding_kv_channels, self.rotary_base, self.sliding_rope_factor, 1.0),
            FULL: (self.full_kv_channels, self.full_rotary_base, self.full_rope_factor, self.full_rotary_proportion),
        }[kind]
        angles = int(proportion * d // 2)
        rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(torch.float32) / d))
        inv = torch.cat([rotated, torch.zeros(d // 2 - angles, dtype=torch.float32)])
        return inv / factor


# ---- Hugging Face config -> DiffusionGemmaConfig -------------------------------------------------

class UnsupportedDiffusionGemmaConfig(ValueError):
    """The Hugging Face config uses an option this Megatron model does not reproduce exactly."""


def text_config_dict(cfg: Any) -> Dict[str, Any]:
    """The text config as a plain dict (from a `DiffusionGemmaConfig`/`Gemma4Config` object, its
    text config, or a config.json dict), with `per_layer_config` as {layer index: overrides}."""
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict()
    cfg = dict(cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg)
    plc = cfg.get("per_layer_config")
    if plc is None:
        # Configs saved before per_layer_config existed carry global_head_dim instead.
        layer_types = cfg.get("layer_types") or []
        overrides = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("num_global_key_value_heads") is not None and cfg.get("attention_k_eq_v", True):
            overrides["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        plc = {i: dict(overrides) for i, t in enumerate(layer_types) if t == FULL}
    cfg["per_layer_config"] = {int(k): dict(v) for k, v in plc.items()}
    return cfg


def config_from_hf(hf_cfg: Any, params_dtype: torch.dtype = torch.float32, k_eq_v_full: bool = True,
                   **overrides) -> DiffusionGemmaConfig:
    """Translate a Hugging Face `diffusion_gemma` (or `gemma4` text MoE) config.

    `k_eq_v_full`: DiffusionGemma full layers always share K and V (no v_proj), whatever
    `attention_k_eq_v` says; for Gemma 4 pass the checkpoint's `attention_k_eq_v`."""
    c = text_config_dict(hf_cfg)
    n = int(c["num_hidden_layers"])
    layer_types = list(c["layer_types"])
    plc = c["per_layer_config"]
    heads = int(c["num_attention_heads"])
    head_dim, kv_heads = int(c["head_dim"]), int(c["num_key_value_heads"])

    def refuse(cond, what):
        if cond:
            raise UnsupportedDiffusionGemmaConfig(what)

    def one_value(kind, key, default):
        vals = {int(plc.get(i, {}).get(key, default)) for i, t in enumerate(layer_types) if t == kind}
        refuse(len(vals) > 1, f"{kind} layers with different {key}: {sorted(vals)}")
        return vals.pop() if vals else default

    for i, over in plc.items():
        unknown = set(over) - {"head_dim", "num_key_value_heads"}
        refuse(bool(unknown), f"per_layer_config[{i}] overrides {sorted(unknown)}")
    sliding_d, sliding_g = one_value(SLIDING, "head_dim", head_dim), one_value(SLIDING, "num_key_value_heads", kv_heads)
    full_d, full_g = one_value(FULL, "head_dim", head_dim), one_value(FULL, "num_key_value_heads", kv_heads)
    refuse(c.get("use_bidirectional_attention") == "all",
           "use_bidirectional_attention='all' (bidirectional clean stream) is not supported: the clean stream is token-causal")
    refuse(c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
           f"hidden_activation {c.get('hidden_activation')!r} (only gelu_pytorch_tanh)")
    refuse(bool(c.get("attention_bias", False)), "attention_bias=True is not supported")
    refuse(float(c.get("attention_dropout") or 0.0) != 0.0, "attention_dropout must be 0")
    refuse(not c.get("num_experts"), "dense (no-expert) configs are not supported by this provider")
    refuse(bool(c.get("hidden_size_per_layer_input")), "per-layer input embeddings (PLE) are not supported")
    refuse(bool(c.get("num_kv_shared_layers")), "KV-shared layers are not supported")
    refuse(bool(c.get("use_double_wide_mlp", False)), "use_double_wide_mlp is not supported")
    refuse(c.get("attn_logit_softcapping") is not None, "attention logit soft-capping is not supported")
    refuse(c.get("tie_word_embeddings") is False, "untied embeddings are not supported")
    rope = c.get("rope_parameters") or {}
    s_rope, f_rope = rope.get(SLIDING, {}), rope.get(FULL, {})
    refuse(s_rope.get("rope_type", "default") != "default", f"sliding rope {s_rope}")
    refuse(f_rope.get("rope_type", "default") not in ("default", "proportional"), f"full rope {f_rope}")
    refuse(s_rope.get("partial_rotary_factor", 1.0) != 1.0, f"sliding rope {s_rope}")
    full_prop = float(f_rope.get("partial_rotary_factor", 1.0))
    refuse(f_rope.get("rope_type", "default") == "default" and full_prop != 1.0,
           "default rope with partial_rotary_factor != 1 is not supported")

    # the shape and sources' options, then DiffusionGemma's fixed choices (`overrides`: parallelism, ...)
    fields = dict(
        num_layers=n, hidden_size=int(c["hidden_size"]), ffn_hidden_size=int(c["intermediate_size"]),
        num_attention_heads=heads, num_query_groups=sliding_g, kv_channels=sliding_d, layer_types=layer_types,
        sliding_window=int(c["sliding_window"]), full_kv_channels=full_d, full_num_query_groups=full_g,
        full_k_eq_v=k_eq_v_full, rotary_base=float(s_rope.get("rope_theta", 10000.0)),
        full_rotary_base=float(f_rope.get("rope_theta", 1_000_000.0)), full_rotary_proportion=full_prop,
        full_rope_factor=float(f_rope.get("factor", 1.0)),
        final_logit_softcapping=c.get("final_logit_softcapping", 30.0), embedding_padding_idx=c.get("pad_token_id", 0),
        layernorm_epsilon=float(c.get("rms_norm_eps", 1e-6)), num_moe_experts=int(c["num_experts"]),
        moe_router_topk=int(c["top_k_experts"]), moe_ffn_hidden_size=int(c["moe_intermediate_size"]),
        normalization="RMSNorm", gated_linear_unit=True, activation_func=gelu_tanh, add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=True, softmax_scale=1.0, **PORTABLE_CONFIG, **dtype_fields(params_dtype),
        **PORTABLE_MOE_CONFIG, moe_router_pre_softmax=False,
    )
    return transformer_config(DiffusionGemmaConfig, **(fields | overrides))
