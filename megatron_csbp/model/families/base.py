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
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{SHAPE_FILE} has unknown fields {unknown}")
        return cls(**data)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.params_dtype]

    # ---- the flags a shape implies (flag_values) ------------------------------------------------
    normalization, swiglu, position_embedding_type = "RMSNorm", True, "rope"
    untie_embeddings_and_output_weights = property(lambda self: not self.tie_word_embeddings)
    use_rope_scaling = property(lambda self: self._rope("llama3") is not None)
    rope_scaling_factor = property(lambda self: self._rope("llama3"))
    rotary_seq_len_interpolation_factor = property(lambda self: self._rope("linear"))
    moe_layer_freq = property(lambda self: self.moe_layer_pattern)

    def _rope(self, kind: str):
        """The rope scaling factor when its type is `kind` (None otherwise)."""
        rope = self.rope_scaling or {}
        if rope and rope.get("type") not in ("llama3", "linear"):  # a hand-edited file
            raise UnsupportedModelError(f"rope scaling {self.rope_scaling} is not supported")
        return rope["factor"] if rope.get("type") == kind else None

    def moe_layers(self) -> List[int]:
        """Indices (0-based) of the MoE layers."""
        pattern = [1] * self.num_layers if self.moe_layer_pattern is None else self.moe_layer_pattern
        return [i for i, m in enumerate(pattern) if m] if self.is_moe else []


def flag_values(shape: ModelShape) -> Dict[str, Any]:
    """The model flags (trainer / Megatron-LM names, by dest) that describe `shape`: the options
    declared with `shape=True`, each the shape's attribute of its name (MoE flags of a dense shape
    and None values: the flag's default; an integral float of an int flag: an int, as Megatron-LM
    parses it). What `--load` of a converted checkpoint fills in and compares
    (training.arguments.apply_model_shape) and what `convert` prints (GPTFamily.megatron_flags)."""
    from megatron_csbp.config.options import OPTIONS

    out = {}
    for o in OPTIONS:
        if o.shape:
            v = getattr(shape, o.name) if shape.is_moe or not o.moe else None
            out[o.name] = o.default if v is None else int(v) if o.type is int and float(v).is_integer() else v
    return out


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
