"""Tensor mapping between Hugging Face checkpoints and Megatron's local-spec `GPTModel` (TP = 1).

Used by the GPT-style families (`gpt`, `qwen3_5`) with their Hugging Face MoE names. The fused QKV
(rows grouped by query group: its q heads, its k head, its v head), SwiGLU `[gate ; up]` and tied
embeddings: docs/conversion.md#tensor-mapping-unsharded-tp--1.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Sequence

import torch

from megatron_csbp.model.families import ModelShape, get_family

# Buffers some older Hugging Face checkpoints carry that hold no weights.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


class ConversionError(ValueError):
    pass


def fuse_groups(parts: List[torch.Tensor], groups: int) -> torch.Tensor:
    """Tensors of rows grouped by query group (`groups` blocks each) -> one tensor whose rows are,
    per group, each part's block in turn (Megatron's fused QKV). Weights [rows, hidden] or biases [rows]."""
    rest = parts[0].shape[1:]
    return torch.cat([p.reshape(groups, -1, *rest) for p in parts], dim=1).reshape(-1, *rest)


def split_groups(fused: torch.Tensor, groups: int, sizes: List[int]) -> List[torch.Tensor]:
    """The inverse of `fuse_groups`: the parts whose blocks have `sizes` rows per group."""
    rest = fused.shape[1:]
    return [p.reshape(-1, *rest) for p in torch.split(fused.reshape(groups, -1, *rest), sizes, dim=1)]


def fuse_gated_qkv(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Qwen3.5 gated attention: q_proj rows are [q_h ; gate_h] per head; Megatron's `linear_qkv`
    with `attention_output_gate` is, per query group, [its q heads, their gates, k, v]."""
    groups, d, rest = shape.num_query_groups, shape.kv_channels, q_gate.shape[1:]
    qg = q_gate.reshape(groups, -1, 2, d, *rest)
    return fuse_groups([qg[:, :, 0].reshape(-1, *rest), qg[:, :, 1].reshape(-1, *rest), k, v], groups)


def split_gated_qkv(qkv: torch.Tensor, shape: ModelShape) -> List[torch.Tensor]:
    groups, d, rest = shape.num_query_groups, shape.kv_channels, qkv.shape[1:]
    q_rows = shape.num_attention_heads // groups * d
    q, gate, k, v = split_groups(qkv, groups, [q_rows, q_rows, d, d])
    q_gate = torch.stack([q.reshape(groups, -1, d, *rest), gate.reshape(groups, -1, d, *rest)], dim=2)
    return [q_gate.reshape(-1, *rest), k, v]


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

    def unused(self) -> List[str]:
        return sorted(n for n in self.tensors if n not in self.used and not n.endswith(IGNORED_HF_SUFFIXES))


class Tensors(NamedTuple):
    """Megatron's tensor `megatron` is `join(*hf tensors)`; `split` is the inverse."""
    megatron: str
    hf: List[str]
    join: Callable[..., torch.Tensor] = lambda t: t
    split: Callable[[torch.Tensor], Sequence[torch.Tensor]] = lambda t: (t,)


def grouped(megatron: str, hf: List[str], groups: int, sizes: List[int]) -> Tensors:
    """`Tensors` whose Hugging Face parts interleave per group (`fuse_groups`), part j `sizes[j]` rows a group."""
    return Tensors(megatron, hf, lambda *parts: fuse_groups(list(parts), groups),
                   lambda t: split_groups(t, groups, sizes))


def _concat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts)


def _halves(t: torch.Tensor) -> Sequence[torch.Tensor]:
    return torch.chunk(t, 2, dim=0)


def tensor_map(shape: ModelShape) -> List[Tensors]:
    """Every Megatron tensor of `shape` with the Hugging Face tensors it is made of, in checkpoint order."""
    groups, d = shape.num_query_groups, shape.kv_channels
    qkv_rows = [shape.num_attention_heads // groups * d, d, d]  # per query group: its q heads, k, v
    moe_layers = set(shape.moe_layers())
    out = [Tensors("embedding.word_embeddings.weight", ["model.embed_tokens.weight"])]
    for i in range(shape.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn, a = h + "self_attn.", m + "self_attention."
        out += [Tensors(m + "input_layernorm.weight", [h + "input_layernorm.weight"]),
                Tensors(m + "pre_mlp_layernorm.weight", [h + "post_attention_layernorm.weight"])]
        if _is_gdn_layer(shape, i):
            la = h + "linear_attn."
            out.append(Tensors(a + "in_proj.weight", [f"{la}{n}.weight" for n in GDN_IN_PROJ], _concat,
                               lambda t: torch.split(t, _gdn_sizes(shape), dim=0)))
            out += [Tensors(a + meg, [la + hf_name]) for meg, hf_name in GDN_SAME.items()]
        elif shape.attention_output_gate:
            out.append(Tensors(a + "linear_qkv.weight", [f"{attn}{p}_proj.weight" for p in "qkv"],
                               lambda q, k, v: fuse_gated_qkv(q, k, v, shape), lambda t: split_gated_qkv(t, shape)))
        else:
            out.append(grouped(a + "linear_qkv.weight", [f"{attn}{p}_proj.weight" for p in "qkv"], groups, qkv_rows))
        if shape.add_qkv_bias:
            out.append(grouped(a + "linear_qkv.bias", [f"{attn}{p}_proj.bias" for p in "qkv"], groups, qkv_rows))
        if not _is_gdn_layer(shape, i):
            if shape.qk_layernorm:
                out += [Tensors(f"{a}{p}_layernorm.weight", [f"{attn}{p}_norm.weight"]) for p in "qk"]
            out.append(Tensors(a + "linear_proj.weight", [attn + "o_proj.weight"]))
        if i in moe_layers:
            # (module prefix, router name, (gate, up, down) expert weight names) of the family
            block, router, (gate, up, down) = get_family(shape.family).hf_moe_names
            out.append(Tensors(m + "mlp.router.weight", [f"{h}{block}.{router}.weight"]))
            for e in range(shape.num_experts):
                x, y = f"{h}{block}.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
                out += [Tensors(y + "linear_fc1.weight", [f"{x}{gate}.weight", f"{x}{up}.weight"], _concat, _halves),
                        Tensors(y + "linear_fc2.weight", [f"{x}{down}.weight"])]
        else:
            out += [Tensors(m + "mlp.linear_fc1.weight", [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"],
                            _concat, _halves),
                    Tensors(m + "mlp.linear_fc2.weight", [h + "mlp.down_proj.weight"])]
    out.append(Tensors("decoder.final_layernorm.weight", ["model.norm.weight"]))
    if not shape.tie_word_embeddings:
        out.append(Tensors("output_layer.weight", ["lm_head.weight"]))
    return out


def hf_to_megatron(shape: ModelShape, hf: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Hugging Face tensors -> the unsharded Megatron state dict. Every Hugging Face tensor must be
    used (an unknown one means an option the model would silently drop)."""
    src = _Source(hf)
    out = {t.megatron: t.join(*map(src.take, t.hf)) for t in tensor_map(shape)}
    if shape.tie_word_embeddings and "lm_head.weight" in src.tensors:
        if not torch.equal(src.take("lm_head.weight"), out["embedding.word_embeddings.weight"]):
            raise ConversionError("tie_word_embeddings=True but lm_head.weight differs from embed_tokens.weight")
    unused = src.unused()
    if unused:
        raise ConversionError(
            f"{len(unused)} Hugging Face tensors have no Megatron counterpart for a {shape.family} model "
            f"(an unsupported option?): {unused[:8]}{' ...' if len(unused) > 8 else ''}"
        )
    return out


def megatron_to_hf(shape: ModelShape, sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The unsharded Megatron state dict -> Hugging Face tensors (on-disk names)."""
    sd = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    src = _Source(sd, "Megatron")
    out: Dict[str, torch.Tensor] = {}
    for t in tensor_map(shape):
        out.update(zip(t.hf, t.split(src.take(t.megatron))))
    left = sorted(set(sd) - src.used)
    if left:
        raise ConversionError(f"Megatron tensors not exported (unexpected for {shape.family}): {left[:8]}")
    return {k: v.contiguous() for k, v in out.items()}


def cast(tensors: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    return {k: v.to(dtype) for k, v in tensors.items()}
