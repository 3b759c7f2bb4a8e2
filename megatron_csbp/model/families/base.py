"""The model shape every tool shares, its file, and what a model family provides.

`ModelShape` is the one description of a model: the converter derives it from a Hugging Face
`config.json` (through the family that reads that `model_type`), writes it next to the Megatron
checkpoint (`megatron_csbp_model.json`), prints the Megatron-LM flags that rebuild the model, and
builds the model from it (`megatron_csbp.model.builder.build_gpt_model`). The trainer takes the
model shape from the same file. `shape.family` names the registered `Family` that owns it.

Size: one shape per model (a few hundred bytes plus the source config.json; `moe_layer_pattern`
and `gated_delta["pattern"]` hold one int per layer), independent of tokens and ranks.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

SHAPE_FILE = "megatron_csbp_model.json"
SHAPE_FORMAT_VERSION = 1

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The Hugging Face model uses an architecture or option this plugin cannot reproduce exactly."""


def refuse_if(condition: bool, what: str) -> None:
    if condition:
        raise UnsupportedModelError(what)


def check_dtype(dtype: str) -> str:
    refuse_if(dtype not in DTYPES, f"dtype {dtype!r} is not supported (one of {sorted(DTYPES)})")
    return dtype


@dataclass
class ModelShape:
    """Everything needed to rebuild the Megatron model (and its Hugging Face counterpart)."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    rotary_base: float
    #: None, {"type": "linear", "factor": f} or {"type": "llama3", "factor": f}
    rope_scaling: Optional[Dict[str, Any]] = None
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    # MoE (num_experts None: dense)
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_pre_softmax: bool = False
    #: 1 where the layer is MoE, 0 where dense (None: every layer MoE)
    moe_layer_pattern: Optional[List[int]] = None
    moe_input_jitter_eps: Optional[float] = None
    #: dtype of the weights in the source checkpoint
    params_dtype: str = "bfloat16"
    #: the source Hugging Face config.json, kept so the export writes it back unchanged
    hf_config: Dict[str, Any] = field(default_factory=dict)
    #: hybrid linear attention (family qwen3_5): {"pattern": [1 = Gated DeltaNet, 0 = attention per
    #: layer], "conv_kernel", "key_head_dim", "value_head_dim", "num_key_heads", "num_value_heads"}
    gated_delta: Optional[Dict[str, Any]] = None
    #: sigmoid output gate on attention (Qwen3.5: q_proj holds [q_h ; gate_h] per head)
    attention_output_gate: bool = False
    #: fraction of each head's dims that rotary embeddings rotate (Qwen3.5: 0.25)
    rotary_percent: float = 1.0
    #: Hugging Face RMSNorms scale by (1 + w) (Qwen3.5): Megatron's spec uses the same norm (w kept as is)
    zero_centered_norms: bool = False
    #: family "diffusion_gemma" only: its source and config options (see model/families/diffusion_gemma.py)
    diffusion_gemma: Optional[Dict[str, Any]] = None
    format_version: int = SHAPE_FORMAT_VERSION

    # ---- files -------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelShape":
        data = json.loads(text)
        version = data.get("format_version", 0)
        if version != SHAPE_FORMAT_VERSION:
            raise ValueError(f"{SHAPE_FILE} has format_version {version}, this code reads {SHAPE_FORMAT_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{SHAPE_FILE} has unknown fields {unknown}")
        return cls(**data)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.params_dtype]

    def moe_layers(self) -> List[int]:
        """Indices (0-based) of the MoE layers."""
        if not self.is_moe:
            return []
        if self.moe_layer_pattern is None:
            return list(range(self.num_layers))
        return [i for i, m in enumerate(self.moe_layer_pattern) if m]


def flag_values(shape: ModelShape) -> Dict[str, Any]:
    """The model flags (trainer / Megatron-LM names, by dest) that describe `shape`: what `--load`
    of a converted checkpoint fills in and compares (training.arguments.apply_model_shape) and what
    `convert` prints (GPTFamily.megatron_flags). Flags a shape leaves at their default have it."""
    rope = shape.rope_scaling or {}
    factor = rope.get("factor")
    return dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels, max_position_embeddings=shape.max_position_embeddings,
        rotary_base=int(shape.rotary_base) if float(shape.rotary_base).is_integer() else shape.rotary_base,
        rotary_percent=shape.rotary_percent, normalization="RMSNorm", norm_epsilon=shape.norm_epsilon, swiglu=True,
        vocab_size=shape.vocab_size, add_qkv_bias=shape.add_qkv_bias, qk_layernorm=shape.qk_layernorm,
        untie_embeddings_and_output_weights=not shape.tie_word_embeddings,
        use_rope_scaling=rope.get("type") == "llama3",
        rope_scaling_factor=factor if rope.get("type") == "llama3" else 8.0,
        # Megatron-LM's flag is an int
        rotary_seq_len_interpolation_factor=(int(factor) if float(factor).is_integer() else factor)
        if rope.get("type") == "linear" else None,
        num_experts=shape.num_experts, moe_router_topk=shape.moe_router_topk if shape.is_moe else 2,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size if shape.is_moe else None,
        moe_layer_freq=shape.moe_layer_pattern if shape.moe_layer_pattern is not None else 1,
        moe_router_pre_softmax=shape.moe_router_pre_softmax, moe_input_jitter_eps=shape.moe_input_jitter_eps)


class Family:
    """What a model family owns: reading its Hugging Face configs (and refusing what it cannot
    reproduce), its Megatron config and model, and its weight mapping both ways. One instance per
    family name, registered with `megatron_csbp.model.families.register_family`.

    Subclasses set `name` (the `ModelShape.family` value) and `model_types` (the Hugging Face
    `model_type`s it reads), and implement the methods below."""

    name: str = ""
    #: Hugging Face `model_type` values this family reads
    model_types: Tuple[str, ...] = ()
    #: Hugging Face `architectures` accepted (empty: not checked)
    architectures: Tuple[str, ...] = ()
    #: `convert score`'s clean stream is always this mask for the family (None: the caller's choice)
    clean_attention: Optional[str] = None
    #: Hugging Face tensors with no Megatron counterpart are kept next to the checkpoint and exported back
    carries_extra_weights: bool = False
    #: Megatron-LM has a flag set that rebuilds this family's models (`megatron_flags`)
    has_megatron_lm_flags: bool = False
    #: `python -m megatron_csbp.train` trains this family's MoE checkpoints (others: through Megatron-LM)
    trainer_trains_moe: bool = False

    # ---- Hugging Face config -> shape --------------------------------------------------------
    def shape_from_hf_config(self, cfg: Dict[str, Any], params_dtype: Optional[str] = None) -> ModelShape:
        raise NotImplementedError

    # ---- shape -> Megatron -------------------------------------------------------------------
    def transformer_config(self, shape: ModelShape, params_dtype: Optional[torch.dtype] = None, **overrides):
        """The megatron-core config of `shape`; `overrides` set parallelism and training options."""
        raise NotImplementedError

    def build_model(self, shape: ModelShape, config, block_diffusion: bool = True, kernel: str = "auto", stage=None):
        """The megatron-core model of `shape` under the current parallel state (`config` given);
        `stage`: its pipeline chunk (`megatron_csbp.parallel.pipeline.Stage`; None: the whole model)."""
        raise NotImplementedError

    def megatron_flags(self, shape: ModelShape) -> List[str]:
        """Megatron-LM command-line flags that rebuild the same model."""
        raise UnsupportedModelError(f"{self.name} models have no Megatron-LM flag set: train with "
                                    "python -m megatron_csbp.train --load CHECKPOINT")

    # ---- weights -----------------------------------------------------------------------------
    def hf_to_megatron(self, shape: ModelShape, tensors: Dict[str, torch.Tensor],
                       cfg: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """(unsharded Megatron state dict, Hugging Face tensors to carry through unchanged)."""
        raise NotImplementedError

    def megatron_to_hf(self, shape: ModelShape, state: Dict[str, torch.Tensor]
                       ) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], Sequence[str]]:
        """(Hugging Face config.json dict, tensors, asset files not to copy). Refuses a model the
        Hugging Face side cannot hold before anything is written."""
        raise NotImplementedError
