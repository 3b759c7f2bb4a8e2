"""Model shapes for the cost model: from Megatron flags or a Hugging Face config.json.

Only what decides FLOPs, bytes and memory is kept: per layer the attention shape (query heads, KV
heads, head dim, sliding window, output gate) or, for a Gated DeltaNet (linear attention) layer of
a Qwen3.5 / Qwen3-Next hybrid, its linear-attention shape (key / value heads and head dims, short
convolution width); the dense MLP and the experts; plus hidden size, vocabulary and whether
embeddings are tied. Norm weights and biases are ignored (well under 0.1% of parameters).
Size: one `LayerShape` per layer (64 for a 27B model), independent of the sequence length.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Optional

PRESET_DIR = os.path.join(os.path.dirname(__file__), "models")


@dataclass(frozen=True)
class LayerShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: Optional[int] = None  # sliding window W (keys q-W < k <= q); None = full attention
    kv_shared: bool = False  # V is derived from the K projection (no v_proj)
    mlp_ffn: int = 0  # dense MLP intermediate size (0 = none)
    num_experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    q_gate: bool = False  # attention output gate (Qwen3.5 / Qwen3-Next `attn_output_gate`): q_proj doubled
    # Gated DeltaNet layer (linear attention) when gdn_value_heads > 0: the attention fields above
    # are then unused. Shapes as Qwen3.5's linear_num_key_heads, linear_num_value_heads,
    # linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim.
    gdn_key_heads: int = 0
    gdn_value_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0
    gdn_conv_kernel: int = 0

    @property
    def is_gdn(self) -> bool:
        return self.gdn_value_heads > 0

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v (megatron's conv_dim)."""
        return 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim

    def attn_params(self, hidden: int) -> int:
        if self.is_gdn:
            # megatron's GatedDeltaNet: in_proj -> [q, k, v, z (gate), beta, alpha], depthwise conv
            # over q, k, v, A_log and dt_bias per value head, out_proj from the value heads
            v = self.gdn_value_heads * self.gdn_value_dim
            in_proj = hidden * (self.gdn_conv_dim + v + 2 * self.gdn_value_heads)
            return in_proj + self.gdn_conv_dim * self.gdn_conv_kernel + 2 * self.gdn_value_heads + v * hidden
        q = hidden * self.num_heads * self.head_dim * (2 if self.q_gate else 1)
        kv = hidden * self.num_kv_heads * self.head_dim * (1 if self.kv_shared else 2)
        o = self.num_heads * self.head_dim * hidden
        return q + kv + o


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden_size: int
    vocab_size: int
    layers: tuple  # of LayerShape
    gated_mlp: bool = True  # SwiGLU / GeGLU: 3 matrices instead of 2
    tied_embeddings: bool = False
    clean_attention: str = "block_causal"
    # DFlash drafter (muse_glimmer_assistant configs): the verifier's hidden states of
    # `target_layers` layers, concatenated, are projected by `fc` into the drafter's width; the
    # verifier's embeddings and LM head (vocab_size x hidden) are read, frozen. 0 = not a drafter.
    target_layers: int = 0

    @property
    def is_drafter(self) -> bool:
        return self.target_layers > 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def layer_dense_params(self, layer: LayerShape) -> int:
        """Parameters every token uses: attention and the dense MLP."""
        return layer.attn_params(self.hidden_size) + self.mlp_matrices * self.hidden_size * layer.mlp_ffn

    def layer_expert_params(self, layer: LayerShape) -> int:
        """Parameters of one expert."""
        return self.mlp_matrices * self.hidden_size * layer.expert_ffn

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def dense_params(self) -> int:
        """Trained dense parameters (a drafter: its layers and `fc`; the verifier's embeddings and
        LM head are frozen, see `frozen_params`)."""
        own = self.target_layers * self.hidden_size * self.hidden_size if self.is_drafter else self.embedding_params
        return sum(self.layer_dense_params(l) for l in self.layers) + own

    @property
    def frozen_params(self) -> int:
        return self.embedding_params if self.is_drafter else 0

    @property
    def expert_params(self) -> int:
        return sum(self.layer_expert_params(l) * l.num_experts for l in self.layers)

    @property
    def total_params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def active_params(self) -> int:
        return self.dense_params + sum(self.layer_expert_params(l) * l.topk for l in self.layers)

    @property
    def is_moe(self) -> bool:
        return any(l.num_experts for l in self.layers)

    @property
    def is_hybrid(self) -> bool:
        return any(l.is_gdn for l in self.layers)

    def summary(self) -> str:
        windows = sorted({l.window for l in self.layers if l.window})
        sliding, gdn = sum(1 for l in self.layers if l.window), sum(1 for l in self.layers if l.is_gdn)
        kinds = f", {sliding} sliding (W={windows}) / {self.num_layers - sliding} full layers" if windows else ""
        if self.is_hybrid:
            kinds += f", {gdn} Gated DeltaNet / {self.num_layers - gdn} attention layers"
        l0 = next((l for l in self.layers if l.num_experts), None)
        moe = f", MoE {l0.num_experts} experts top-{l0.topk}" if l0 else ""
        return (f"{self.name}: {self.total_params / 1e9:.2f}B params ({self.active_params / 1e9:.2f}B active), "
                f"{self.num_layers} layers, hidden {self.hidden_size}{kinds}{moe}")


def _req(cfg: Dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is not None:
        return default
    raise ValueError(f"config.json has none of {list(keys)}")


def from_hf_config(cfg: Dict, name: Optional[str] = None) -> ModelConfig:
    """Llama / Mistral / Qwen2-3 / Qwen-MoE / Mixtral / Gemma-style config.json (also nested
    `text_config`). Sliding layers come from `layer_types` or `sliding_window_pattern`; Gemma-4-style
    full layers may have their own `global_head_dim` / `num_global_key_value_heads` and
    `attention_k_eq_v` (DiffusionGemma)."""
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k in ("name",)}}
    hidden = int(_req(cfg, "hidden_size", "d_model"))
    n_layers = int(_req(cfg, "num_hidden_layers", "num_layers", "n_layer"))
    heads = int(_req(cfg, "num_attention_heads", "n_head"))
    kv = int(_req(cfg, "num_key_value_heads", default=heads))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(_req(cfg, "vocab_size"))
    ffn = int(cfg.get("intermediate_size") or 0)
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    topk = int(cfg.get("num_experts_per_tok") or cfg.get("top_k_experts") or cfg.get("moe_topk") or 0)
    expert_ffn = int(cfg.get("moe_intermediate_size") or cfg.get("expert_intermediate_size") or 0)
    if experts and not expert_ffn:
        expert_ffn, ffn = ffn, 0
    if experts and not topk:
        raise ValueError("MoE config.json needs num_experts_per_tok")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    dense = not experts or cfg.get("enable_moe_block") or cfg.get("dense_mlp_with_experts")
    dense_ffn = (ffn if dense else 0) + shared
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    gdn = _gdn_shape(cfg)
    if layer_types is None and gdn and cfg.get("full_attention_interval"):
        # Qwen3.5 / Qwen3-Next: layer i is full attention iff (i + 1) % interval == 0
        # (the rule of `megatron_csbp.model.hybrid.linear_attention_pattern`)
        interval = int(cfg["full_attention_interval"])
        if interval < 1:
            raise ValueError(f"full_attention_interval must be >= 1, got {interval}")
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if layer_types is not None and "linear_attention" in layer_types and not gdn:
        raise ValueError("layer_types has linear_attention layers but the config lacks linear_num_value_heads "
                         "(Gated DeltaNet shape: linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, "
                         "linear_value_head_dim, linear_conv_kernel_dim)")
    if layer_types is None and window:
        pattern = cfg.get("sliding_window_pattern")
        if pattern:  # every pattern-th layer is full (Gemma 2/3)
            layer_types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                           for i in range(n_layers)]
        elif cfg.get("use_sliding_window", True):
            layer_types = ["sliding_attention"] * n_layers
    if layer_types is None:
        layer_types = ["full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    full_head_dim = int(cfg.get("global_head_dim") or head_dim)
    full_kv = int(cfg.get("num_global_key_value_heads") or kv)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    q_gate = bool(cfg.get("attn_output_gate", False))
    mlp = dict(mlp_ffn=dense_ffn, num_experts=experts, topk=topk if experts else 0,
               expert_ffn=expert_ffn if experts else 0)
    drafter = cfg.get("model_type") == "muse_glimmer_assistant" or cfg.get("target_layer_ids") is not None
    if window and cfg.get("model_type") == "muse_glimmer_assistant":
        # Hugging Face's drafter window: a row at p sees context >= p - sliding_window, i.e. the
        # project's W = sliding_window + 1 (`DrafterShape.window`)
        window = int(window) + 1
    layers = []
    for t in layer_types:
        sliding = t in ("sliding_attention", "sliding", "local")
        if t == "linear_attention":
            layers.append(LayerShape(num_heads=heads, num_kv_heads=kv, head_dim=head_dim, **mlp, **gdn))
        else:
            layers.append(LayerShape(num_heads=heads, num_kv_heads=kv if sliding else full_kv, q_gate=q_gate,
                                     head_dim=head_dim if sliding else full_head_dim,
                                     window=int(window) if sliding else None, kv_shared=(k_eq_v and not sliding), **mlp))
    act = str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu")
    gated = bool(cfg.get("gated_mlp", act in ("silu", "swiglu", "gelu_pytorch_tanh", "gelu", "geglu")))
    return ModelConfig(
        name=name or cfg.get("name") or cfg.get("_name_or_path") or cfg.get("model_type") or "hf-model",
        hidden_size=hidden, vocab_size=vocab, layers=tuple(layers), gated_mlp=gated,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        clean_attention=cfg.get("clean_attention", "block_causal"),
        target_layers=len(cfg.get("target_layer_ids") or [1, 13, 25, 37, 49]) if drafter else 0)


def _gdn_shape(cfg: Dict) -> Dict:
    """Gated DeltaNet shape of a Qwen3.5 / Qwen3-Next config (transformers' defaults where a key is
    absent: 16 key heads, 128-wide heads, kernel 4), or {} when the config has none."""
    if not cfg.get("linear_num_value_heads"):
        return {}
    shape = dict(gdn_key_heads=int(cfg.get("linear_num_key_heads") or 16),
                 gdn_value_heads=int(cfg["linear_num_value_heads"]),
                 gdn_key_dim=int(cfg.get("linear_key_head_dim") or 128),
                 gdn_value_dim=int(cfg.get("linear_value_head_dim") or 128),
                 gdn_conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4))
    if shape["gdn_value_heads"] % shape["gdn_key_heads"]:
        raise ValueError(f"linear_num_value_heads {shape['gdn_value_heads']} must be a multiple of "
                         f"linear_num_key_heads {shape['gdn_key_heads']}")
    return shape


def load_hf_config(path: str, name: Optional[str] = None) -> ModelConfig:
    """A Hugging Face config.json, or a model folder holding one (ValueError naming --hf-config otherwise);
    `name`: the model's (default: the config's own, else its folder's)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--hf-config {path}: no such file (give a config.json or the folder that holds it)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--hf-config {path}: not a readable JSON config ({exc})") from None
    return from_hf_config(cfg, name or cfg.get("name") or os.path.basename(os.path.dirname(os.path.abspath(path))))


def presets() -> Dict[str, str]:
    """Built-in model configs (HF-style JSON) by name."""
    return {f[:-5]: os.path.join(PRESET_DIR, f) for f in sorted(os.listdir(PRESET_DIR)) if f.endswith(".json")}


def load_preset(name: str) -> ModelConfig:
    table = presets()
    if name not in table:
        raise ValueError(f"--model {name!r} is not a preset; choose from {sorted(table)}")
    return load_hf_config(table[name], name)


def from_megatron_args(args, name: str = "megatron-flags") -> ModelConfig:
    """Megatron-LM model flags (same names and defaults where they exist), read as the config.json
    they describe."""
    hidden, heads = args.hidden_size, args.num_attention_heads
    if hidden is None or heads is None or args.num_layers is None:
        raise ValueError("give --hf-config FILE, --model PRESET, or at least --num-layers, --hidden-size and "
                         "--num-attention-heads")
    if hidden % heads and args.kv_channels is None:
        raise ValueError(f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads}; set --kv-channels")
    kv = args.num_query_groups if args.group_query_attention else heads
    if heads % kv:
        raise ValueError(f"--num-attention-heads {heads} must be divisible by --num-query-groups {kv}")
    vocab = args.padded_vocab_size or args.vocab_size
    if vocab is None:
        raise ValueError("give --vocab-size (or --padded-vocab-size)")
    left = int(str(args.window_size).split(",")[0]) if args.window_size else -1
    skip, experts = args.window_attn_skip_freq, args.num_experts
    # the config.json these flags describe (`from_hf_config` reads it)
    return from_hf_config(dict(
        hidden_size=hidden, num_hidden_layers=args.num_layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=args.kv_channels, vocab_size=vocab,
        intermediate_size=args.ffn_hidden_size or (4 * hidden if not args.swiglu else int(8 * hidden / 3)),
        num_experts=experts, num_experts_per_tok=args.moe_router_topk, moe_intermediate_size=args.moe_ffn_hidden_size,
        shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size if experts else None,
        sliding_window=left + 1 if left >= 0 else None, gated_mlp=bool(args.swiglu),
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
        layer_types=["full_attention" if left < 0 or (skip and i % skip == 0) else "sliding_attention"
                     for i in range(1, args.num_layers + 1)]), name)


def from_flags(values: Dict, name: str) -> ModelConfig:
    """The model of the trainer's flags `values` (by dest, e.g. a benchmark's model): a flag not
    given has Megatron-LM's default, as `plan` parses it; --num-query-groups alone sets the K/V heads,
    as in the trainer."""
    import argparse

    parser = argparse.ArgumentParser()
    add_megatron_model_args(parser)
    args = parser.parse_args([])
    vars(args).update((k, v) for k, v in values.items() if hasattr(args, k))
    args.group_query_attention = values.get("num_query_groups") is not None
    return from_megatron_args(args, name)


_INT, _SWITCH = dict(type=int), dict(action="store_true")
# the model flags (Megatron-LM's names and defaults), in --help's order
_MODEL_FLAGS = (
    ("--num-layers", _INT), ("--hidden-size", _INT), ("--num-attention-heads", _INT),
    ("--group-query-attention", _SWITCH), ("--num-query-groups", dict(type=int, default=1)), ("--kv-channels", _INT),
    ("--ffn-hidden-size", _INT), ("--swiglu", _SWITCH), ("--vocab-size", _INT), ("--padded-vocab-size", _INT),
    ("--untie-embeddings-and-output-weights", _SWITCH), ("--num-experts", _INT),
    ("--moe-router-topk", dict(type=int, default=2)), ("--moe-ffn-hidden-size", _INT),
    ("--moe-shared-expert-intermediate-size", _INT),
    ("--window-size", dict(type=str, help="'LEFT,RIGHT' as in Megatron, e.g. 1023,0")),
    ("--window-attn-skip-freq", dict(type=int, help="every N-th layer is full attention")),
)


def add_megatron_model_args(p) -> None:
    g = p.add_argument_group("model (Megatron-LM flag names)")
    for flag, kwargs in _MODEL_FLAGS:
        g.add_argument(flag, **kwargs)
