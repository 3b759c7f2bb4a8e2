"""Tensor mapping between Hugging Face checkpoints and Megatron's local-spec `GPTModel` (TP = 1).

Used by the GPT-style families (`gpt`, `qwen3_5`) with their Hugging Face MoE names. The fused QKV
(rows grouped by query group: its q heads, its k head, its v head), SwiGLU `[gate ; up]` and tied
embeddings: docs/conversion.md#tensor-mapping-unsharded-tp--1.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from megatron_csbp.model.families import ModelShape, get_family

# Buffers some older Hugging Face checkpoints carry that hold no weights.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


class ConversionError(ValueError):
    pass


MoENames = Tuple[str, str, Tuple[str, str, str]]


def _moe_names(shape: ModelShape, moe_names: Optional[MoENames]) -> MoENames:
    """(module prefix, router name, (gate, up, down) expert weight names) of a MoE family: the
    family's own (`GPTFamily.hf_moe_names`) unless given."""
    return moe_names if moe_names is not None else get_family(shape.family).hf_moe_names


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """[q; k; v] (Hugging Face) -> Megatron's per-group interleaved layout. Works for weights
    [rows, hidden] and biases [rows]."""
    groups, d = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per_group + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups
    rest = qkv.shape[1:]
    qkv = qkv.reshape(groups, (per_group + 2) * d, *rest)
    q, k, v = torch.split(qkv, [per_group * d, d, d], dim=1)
    return (q.reshape(groups * per_group * d, *rest), k.reshape(groups * d, *rest), v.reshape(groups * d, *rest))


def fuse_gated_qkv(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Qwen3.5 gated attention: q_proj rows are [q_h ; gate_h] per head; Megatron's `linear_qkv`
    with `attention_output_gate` is, per query group, [its q heads, their gates, k, v]."""
    groups, d = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups
    rest = q_gate.shape[1:]
    qg = q_gate.reshape(groups, per_group, 2, d, *rest)
    q, gate = qg[:, :, 0].reshape(groups, per_group * d, *rest), qg[:, :, 1].reshape(groups, per_group * d, *rest)
    return torch.cat([q, gate, k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1).reshape(
        groups * (2 * per_group + 2) * d, *rest)


def split_gated_qkv(qkv: torch.Tensor, shape: ModelShape) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups
    rest = qkv.shape[1:]
    q, gate, k, v = torch.split(qkv.reshape(groups, (2 * per_group + 2) * d, *rest),
                                [per_group * d, per_group * d, d, d], dim=1)
    q_gate = torch.stack([q.reshape(groups, per_group, d, *rest), gate.reshape(groups, per_group, d, *rest)], dim=2)
    return q_gate.reshape(groups * per_group * 2 * d, *rest), k.reshape(groups * d, *rest), v.reshape(groups * d, *rest)


#: Gated DeltaNet tensors: Megatron (under `self_attention.`) <- Hugging Face (under `linear_attn.`).
#: Megatron's `in_proj` is [q, k, v | z | beta | alpha] = Hugging Face [in_proj_qkv ; in_proj_z ;
#: in_proj_b ; in_proj_a] (same q/k/v order in the conv channels).
GDN_IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
GDN_SAME = {"conv1d.weight": "conv1d.weight", "dt_bias": "dt_bias", "A_log": "A_log",
            "out_norm.weight": "norm.weight", "out_proj.weight": "out_proj.weight"}


def _gdn_sizes(shape: ModelShape) -> List[int]:
    gd = shape.gated_delta
    qk, v = gd["num_key_heads"] * gd["key_head_dim"], gd["num_value_heads"] * gd["value_head_dim"]
    return [2 * qk + v, v, gd["num_value_heads"], gd["num_value_heads"]]


def _is_gdn_layer(shape: ModelShape, i: int) -> bool:
    return shape.gated_delta is not None and bool(shape.gated_delta["pattern"][i])


class _Source:
    """A checkpoint's tensors (Hugging Face's, or Megatron's on export), each to be consumed exactly once."""

    def __init__(self, tensors: Dict[str, torch.Tensor], checkpoint: str = "Hugging Face"):
        self.tensors, self.checkpoint = tensors, checkpoint
        self.used = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ConversionError(f"the {self.checkpoint} checkpoint has no tensor {name!r}")
        self.used.add(name)
        return self.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def unused(self) -> List[str]:
        return sorted(n for n in self.tensors if n not in self.used and not n.endswith(IGNORED_HF_SUFFIXES))


def hf_to_megatron(shape: ModelShape, hf: Dict[str, torch.Tensor],
                   moe_names: Optional[MoENames] = None) -> Dict[str, torch.Tensor]:
    """Hugging Face tensors -> the unsharded Megatron state dict. Every Hugging Face tensor must be
    used (an unknown one means an option the model would silently drop)."""
    src = _Source(hf)
    out: Dict[str, torch.Tensor] = {}
    out["embedding.word_embeddings.weight"] = src.take("model.embed_tokens.weight")
    moe_layers = set(shape.moe_layers())
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        out[m + "input_layernorm.weight"] = src.take(h + "input_layernorm.weight")
        out[m + "pre_mlp_layernorm.weight"] = src.take(h + "post_attention_layernorm.weight")
        if _is_gdn_layer(shape, i):
            la = h + "linear_attn."
            out[m + "self_attention.in_proj.weight"] = torch.cat([src.take(f"{la}{n}.weight") for n in GDN_IN_PROJ])
            for meg, hf_name in GDN_SAME.items():
                out[m + "self_attention." + meg] = src.take(la + hf_name)
        elif shape.attention_output_gate:
            out[m + "self_attention.linear_qkv.weight"] = fuse_gated_qkv(
                src.take(attn + "q_proj.weight"), src.take(attn + "k_proj.weight"), src.take(attn + "v_proj.weight"), shape)
        else:
            out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
                src.take(attn + "q_proj.weight"), src.take(attn + "k_proj.weight"), src.take(attn + "v_proj.weight"), shape)
        if shape.add_qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                src.take(attn + "q_proj.bias"), src.take(attn + "k_proj.bias"), src.take(attn + "v_proj.bias"), shape)
        if shape.qk_layernorm and not _is_gdn_layer(shape, i):
            out[m + "self_attention.q_layernorm.weight"] = src.take(attn + "q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = src.take(attn + "k_norm.weight")
        if not _is_gdn_layer(shape, i):
            out[m + "self_attention.linear_proj.weight"] = src.take(attn + "o_proj.weight")
        if i in moe_layers:
            block, router, (gate, up, down) = _moe_names(shape, moe_names)
            out[m + "mlp.router.weight"] = src.take(f"{h}{block}.{router}.weight")
            for e in range(shape.num_experts):
                x = f"{h}{block}.experts.{e}."
                y = f"{m}mlp.experts.local_experts.{e}."
                out[y + "linear_fc1.weight"] = torch.cat([src.take(x + f"{gate}.weight"), src.take(x + f"{up}.weight")])
                out[y + "linear_fc2.weight"] = src.take(x + f"{down}.weight")
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat(
                [src.take(h + "mlp.gate_proj.weight"), src.take(h + "mlp.up_proj.weight")])
            out[m + "mlp.linear_fc2.weight"] = src.take(h + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = src.take("model.norm.weight")
    if shape.tie_word_embeddings:
        if src.has("lm_head.weight"):
            lm_head = src.take("lm_head.weight")
            if not torch.equal(lm_head, out["embedding.word_embeddings.weight"]):
                raise ConversionError("tie_word_embeddings=True but lm_head.weight differs from embed_tokens.weight")
    else:
        out["output_layer.weight"] = src.take("lm_head.weight")
    unused = src.unused()
    if unused:
        raise ConversionError(
            f"{len(unused)} Hugging Face tensors have no Megatron counterpart for a {shape.family} model "
            f"(an unsupported option?): {unused[:8]}{' ...' if len(unused) > 8 else ''}"
        )
    return out


def megatron_to_hf(shape: ModelShape, sd: Dict[str, torch.Tensor],
                   moe_names: Optional[MoENames] = None) -> Dict[str, torch.Tensor]:
    """The unsharded Megatron state dict -> Hugging Face tensors (on-disk names)."""
    sd = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    src = _Source(sd, "Megatron")
    take = src.take
    out: Dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = take("embedding.word_embeddings.weight")
    moe_layers = set(shape.moe_layers())
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        out[h + "input_layernorm.weight"] = take(m + "input_layernorm.weight")
        out[h + "post_attention_layernorm.weight"] = take(m + "pre_mlp_layernorm.weight")
        if _is_gdn_layer(shape, i):
            la = h + "linear_attn."
            parts = torch.split(take(m + "self_attention.in_proj.weight"), _gdn_sizes(shape), dim=0)
            for n, part in zip(GDN_IN_PROJ, parts):
                out[f"{la}{n}.weight"] = part
            for meg, hf_name in GDN_SAME.items():
                out[la + hf_name] = take(m + "self_attention." + meg)
        else:
            split = split_gated_qkv if shape.attention_output_gate else split_qkv
            q, k, v = split(take(m + "self_attention.linear_qkv.weight"), shape)
            out[attn + "q_proj.weight"], out[attn + "k_proj.weight"], out[attn + "v_proj.weight"] = q, k, v
        if shape.add_qkv_bias:
            q, k, v = split_qkv(take(m + "self_attention.linear_qkv.bias"), shape)
            out[attn + "q_proj.bias"], out[attn + "k_proj.bias"], out[attn + "v_proj.bias"] = q, k, v
        if shape.qk_layernorm and not _is_gdn_layer(shape, i):
            out[attn + "q_norm.weight"] = take(m + "self_attention.q_layernorm.weight")
            out[attn + "k_norm.weight"] = take(m + "self_attention.k_layernorm.weight")
        if not _is_gdn_layer(shape, i):
            out[attn + "o_proj.weight"] = take(m + "self_attention.linear_proj.weight")
        if i in moe_layers:
            block, router, (gate, up, down) = _moe_names(shape, moe_names)
            out[f"{h}{block}.{router}.weight"] = take(m + "mlp.router.weight")
            for e in range(shape.num_experts):
                x = f"{h}{block}.experts.{e}."
                y = f"{m}mlp.experts.local_experts.{e}."
                g, u = torch.chunk(take(y + "linear_fc1.weight"), 2, dim=0)
                out[x + f"{gate}.weight"], out[x + f"{up}.weight"] = g, u
                out[x + f"{down}.weight"] = take(y + "linear_fc2.weight")
        else:
            g, u = torch.chunk(take(m + "mlp.linear_fc1.weight"), 2, dim=0)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = g, u
            out[h + "mlp.down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = take("output_layer.weight")
    left = sorted(set(sd) - src.used)
    if left:
        raise ConversionError(f"Megatron tensors not exported (unexpected for {shape.family}): {left[:8]}")
    return {k: v.contiguous() for k, v in out.items()}


def cast(tensors: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    return {k: v.to(dtype) for k, v in tensors.items()}


def names(tensors: Iterable[str]) -> List[str]:
    return sorted(tensors)
