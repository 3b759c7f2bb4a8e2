"""Hugging Face `diffusion_gemma` <-> Megatron `DiffusionGemmaModel` state dicts (full, unsharded).

Import checks every encoder duplicate against the decoder copy; the two `layer_scalar` copies are
kept apart; vision weights are returned untouched for export. Both layouts (see `tensor_map`):
docs/diffusiongemma.md#conversion.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_csbp.model.families.gpt_weights import ConversionError, Tensors, _concat, _halves, grouped
from megatron_csbp.model.diffusiongemma.config import DiffusionGemmaConfig, config_from_hf

HF_TEXT = "model.decoder."
HF_ENCODER = "model.encoder.language_model."


#: (Hugging Face name under `layers.{i}.`, Megatron name under `decoder.layers.{i}.`) of each layer's
#: tensors renamed as they are
_LAYER_NAMES = (
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
    ("pre_feedforward_layernorm.weight", "mlp.pre_dense_layernorm.weight"),
    ("post_feedforward_layernorm_1.weight", "mlp.post_dense_layernorm.weight"),
    ("pre_feedforward_layernorm_2.weight", "mlp.pre_experts_layernorm.weight"),
    ("post_feedforward_layernorm_2.weight", "mlp.post_experts_layernorm.weight"),
    ("post_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"),
    ("mlp.down_proj.weight", "mlp.dense.linear_fc2.weight"),
    ("router.proj.weight", "mlp.router.weight"),
    ("router.scale", "mlp.router.scale"),
    ("router.per_expert_scale", "mlp.router.per_expert_scale"),
    ("layer_scalar", "layer_scalar"),
)


def _layer_shape(config: DiffusionGemmaConfig, i: int):
    c = config.get_config_for_layer(i + 1)
    return config.num_attention_heads, c.num_query_groups, c.kv_channels, config.k_eq_v(i + 1)


def qkv_tensors(config: DiffusionGemmaConfig, i: int) -> Tensors:
    """Layer i's fused QKV: per query group its q heads, k and (unless K=V) v (Megatron's order)."""
    heads, groups, d, k_eq_v = _layer_shape(config, i)
    hf = [f"{HF_TEXT}layers.{i}.self_attn.{p}_proj.weight" for p in ("qk" if k_eq_v else "qkv")]
    return grouped(f"decoder.layers.{i}.self_attention.linear_qkv.weight", hf, groups,
                   [heads // groups * d] + [d] * (len(hf) - 1))


def tensor_map(config: DiffusionGemmaConfig) -> List[Tensors]:
    """Every Megatron tensor but the experts' with the Hugging Face tensors it is made of (the
    decoder's; `clean_layer_scalar` is the encoder's `layer_scalar`)."""
    sc = HF_TEXT + "self_conditioning."
    out = [Tensors("embedding.word_embeddings.weight", [HF_TEXT + "embed_tokens.weight"]),
           Tensors("decoder.final_layernorm.weight", [HF_TEXT + "norm.weight"]),
           Tensors("self_conditioning_norm.weight", [sc + "pre_norm.weight"]),
           Tensors("self_conditioning_mlp.linear_fc1.weight", [sc + "gate_proj.weight", sc + "up_proj.weight"],
                   _concat, _halves),
           Tensors("self_conditioning_mlp.linear_fc2.weight", [sc + "down_proj.weight"])]
    for i in range(config.num_layers):
        hp, m = f"{HF_TEXT}layers.{i}.", f"decoder.layers.{i}."
        out += [Tensors(m + meg, [hp + hf]) for hf, meg in _LAYER_NAMES]
        out += [Tensors(m + "clean_layer_scalar", [f"{HF_ENCODER}layers.{i}.layer_scalar"]), qkv_tensors(config, i),
                Tensors(m + "mlp.dense.linear_fc1.weight", [hp + "mlp.gate_proj.weight", hp + "mlp.up_proj.weight"],
                        _concat, _halves)]
    return out


def _expert_prefixes(i: int) -> Tuple[str, str]:
    """(Hugging Face prefix of layer i's stacked expert tensors, Megatron prefix of its experts)."""
    return f"{HF_TEXT}layers.{i}.experts.", f"decoder.layers.{i}.mlp.experts.local_experts."


def hf_to_megatron_state(hf_state: Dict[str, torch.Tensor], hf_config: Any,
                         config: Optional[DiffusionGemmaConfig] = None
                         ) -> Tuple[Dict[str, torch.Tensor], DiffusionGemmaConfig, Dict[str, torch.Tensor]]:
    """Returns (Megatron state dict, the model's config, HF tensors without a Megatron counterpart).

    `hf_config`: the HF config object or its config.json dict (`per_layer_config` is read from it).
    """
    if config is None:
        config = config_from_hf(hf_config)
    used = set()

    def check_copy(key, reference, what):
        if key in hf_state:
            used.add(key)
            if hf_state[key].shape != reference.shape or not torch.equal(hf_state[key], reference):
                raise ConversionError(f"{key} differs from the shared copy {what}: the checkpoint's encoder "
                                      "and decoder weights must be tied")

    def take(key):
        """The tensor `key`; a decoder tensor's encoder copy checked against it (tied weights, the
        `layer_scalar`s aside); a missing encoder `layer_scalar`: the decoder's (one for both streams)."""
        if key.startswith(HF_ENCODER) and key not in hf_state:
            key = HF_TEXT + key[len(HF_ENCODER):]
        if key not in hf_state:
            raise ConversionError(f"Hugging Face state dict lacks {key}")
        used.add(key)
        if key.startswith(HF_TEXT) and not key.endswith("layer_scalar"):
            check_copy(HF_ENCODER + key[len(HF_TEXT):], hf_state[key], key)
        return hf_state[key]

    for i in range(config.num_layers):
        heads, groups, d, k_eq_v = _layer_shape(config, i)
        attn = f"{HF_TEXT}layers.{i}.self_attn."
        q, k = take(attn + "q_proj.weight"), take(attn + "k_proj.weight")
        has_v = (attn + "v_proj.weight") in hf_state
        if has_v == k_eq_v:
            raise ConversionError(f"layer {i}: v_proj {'present' if has_v else 'missing'} but the config says "
                                  f"{'K=V' if k_eq_v else 'separate V'}")
        if q.shape[0] != heads * d or k.shape[0] != groups * d:
            raise ConversionError(f"layer {i}: q/k shapes {tuple(q.shape)}/{tuple(k.shape)} do not match "
                                  f"{heads} heads, {groups} KV heads of dim {d} (per_layer_config)")
    out = {t.megatron: t.join(*map(take, t.hf)) for t in tensor_map(config)}
    check_copy("lm_head.weight", out["embedding.word_embeddings.weight"], HF_TEXT + "embed_tokens.weight")
    for i in range(config.num_layers):
        hf, experts = _expert_prefixes(i)
        gate_up, down = take(hf + "gate_up_proj"), take(hf + "down_proj")
        if gate_up.shape[0] != config.num_moe_experts:
            raise ConversionError(f"layer {i}: {gate_up.shape[0]} experts, config says {config.num_moe_experts}")
        for e in range(config.num_moe_experts):
            out[f"{experts}{e}.linear_fc1.weight"], out[f"{experts}{e}.linear_fc2.weight"] = gate_up[e], down[e]

    text_left = sorted(k for k in hf_state if k not in used and (k.startswith(HF_TEXT) or k.startswith(HF_ENCODER)))
    if text_left:
        raise ConversionError(f"text weights with no Megatron counterpart: {text_left[:8]}")
    return out, config, {k: v for k, v in hf_state.items() if k not in used}


def megatron_to_hf_state(state: Dict[str, torch.Tensor], config: DiffusionGemmaConfig,
                         extra: Optional[Dict[str, torch.Tensor]] = None, tied_copies: bool = False
                         ) -> Dict[str, torch.Tensor]:
    """The Hugging Face state dict as `save_pretrained` writes it (decoder copy of the text weights,
    encoder `layer_scalar`s, `extra` such as vision weights passed through). `tied_copies=True`
    also writes the encoder copies and `lm_head.weight`, i.e. a live model's `state_dict()`."""
    state = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    used = set()

    def take(key):
        used.add(key)
        return state[key]

    out = {hf: part for t in tensor_map(config) for hf, part in zip(t.hf, t.split(take(t.megatron)))}
    for i in range(config.num_layers):
        hf, experts = _expert_prefixes(i)
        for name, fc in (("gate_up_proj", "fc1"), ("down_proj", "fc2")):
            out[hf + name] = torch.stack([take(f"{experts}{e}.linear_{fc}.weight")
                                          for e in range(config.num_moe_experts)])
    left = sorted(k for k in state if k not in used and k != "output_layer.weight")
    if left:
        raise ConversionError(f"Megatron tensors with no Hugging Face counterpart: {left[:8]}")
    if tied_copies:
        for key in list(out):
            if key.startswith(HF_TEXT) and "self_conditioning." not in key and not key.endswith("layer_scalar"):
                out[HF_ENCODER + key[len(HF_TEXT):]] = out[key]
        out["lm_head.weight"] = out[HF_TEXT + "embed_tokens.weight"]
    return {k: v.contiguous() for k, v in out.items()} | (extra or {})


# ---- Gemma 4 text MoE checkpoints (AR starting points) ---------------------------------------

GEMMA4_PREFIXES = ("model.language_model.", "model.")  # Gemma4ForConditionalGeneration, Gemma4ForCausalLM


def gemma4_to_megatron_state(hf_state: Dict[str, torch.Tensor], hf_config: Any, seed: int = 0,
                             init_std: Optional[float] = None
                             ) -> Tuple[Dict[str, torch.Tensor], DiffusionGemmaConfig, Dict[str, torch.Tensor]]:
    """A Gemma 4 text MoE checkpoint (`enable_moe_block`, no per-layer inputs, no KV sharing) as the
    starting point of a DiffusionGemma: same layers, embedding, final norm and soft-cap; K=V on full
    layers only where `attention_k_eq_v` says so; one `layer_scalar` used for both streams.

    The self-conditioning block does not exist in Gemma 4. It is created as a no-op: pre-norm
    weight 1, gate/up N(0, init_std) (default: the config's initializer_range), down-projection 0,
    so the canvas embedding starts as rmsnorm_noscale(E[z] * scale). Returns (state, config,
    HF tensors without a Megatron counterpart, e.g. vision/audio towers)."""
    from megatron_csbp.model.diffusiongemma.config import text_config_dict

    c = text_config_dict(hf_config)
    if not c.get("enable_moe_block", False):
        raise ConversionError("Gemma 4 checkpoint without the MoE block (enable_moe_block=False) is not supported")
    prefix = next((p for p in GEMMA4_PREFIXES if p + "embed_tokens.weight" in hf_state), None)
    if prefix is None:
        raise ConversionError(f"no Gemma 4 text weights under {GEMMA4_PREFIXES}")
    config = config_from_hf(c, k_eq_v_full=bool(c.get("attention_k_eq_v", False)),
                            final_logit_softcapping=c.get("final_logit_softcapping"))
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    g = torch.Generator().manual_seed(seed)
    std = float(init_std if init_std is not None else c.get("initializer_range", 0.02))
    dtype = hf_state[prefix + "embed_tokens.weight"].dtype
    sc = {
        "self_conditioning.pre_norm.weight": torch.ones(hidden, dtype=dtype),
        "self_conditioning.gate_proj.weight": (std * torch.randn(ffn, hidden, generator=g)).to(dtype),
        "self_conditioning.up_proj.weight": (std * torch.randn(ffn, hidden, generator=g)).to(dtype),
        "self_conditioning.down_proj.weight": torch.zeros(hidden, ffn, dtype=dtype),
    }
    towers = tuple(prefix + n for n in ("vision", "audio", "embed_vision", "embed_audio"))
    renamed = {HF_TEXT + k[len(prefix):]: v for k, v in hf_state.items() if k.startswith(prefix)
               and not k.startswith(towers)}
    renamed.update({HF_TEXT + k: v for k, v in sc.items()})
    if "lm_head.weight" in hf_state:
        renamed["lm_head.weight"] = hf_state["lm_head.weight"]
    state, config, _ = hf_to_megatron_state(renamed, c, config=config)
    used = {k for k in hf_state if k.startswith(prefix) and HF_TEXT + k[len(prefix):] in renamed} | {"lm_head.weight"}
    return state, config, {k: v for k, v in hf_state.items() if k not in used}
