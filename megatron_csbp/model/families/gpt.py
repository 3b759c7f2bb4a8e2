"""Megatron-core `GPTModel`s that reproduce Hugging Face decoder families exactly.

`ModelShape` is the one description of a model that every tool shares: the converter derives it
from a Hugging Face `config.json` (`shape_from_hf_config`), writes it next to the Megatron checkpoint
(`megatron_csbp_model.json`), prints the Megatron-LM flags that rebuild the model
(`megatron_flags`), and builds the model from it (`build_gpt_model`). The trainer takes the model
shape from the same file.

Supported: Llama (incl. Llama 3.x rope scaling), Qwen2 (q/k/v bias), Qwen3 (QK-norm), Qwen3-MoE and
Mixtral (Megatron MoE layers, `SequentialMLP` experts), tied or untied embeddings, GQA, rotary base
and linear / llama3 rope scaling. Anything else is refused with a message that names the option.

Megatron's local (torch) layer spec is used: RMSNorm (`torch.nn.RMSNorm`), SwiGLU
(`gated_linear_unit`, silu), no linear biases except the optional fused QKV bias.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

SHAPE_FILE = "megatron_csbp_model.json"
SHAPE_FORMAT_VERSION = 1

#: HF `model_type` -> family handled here
FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "qwen3_5_text": "qwen3_5",
}
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen3_5ForCausalLM": "qwen3_5",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The Hugging Face model uses an architecture or option this plugin cannot reproduce exactly."""


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
    #: family "diffusion_gemma" only: its source and config options (see model/diffusiongemma/provider.py)
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


# ---- Hugging Face config -> shape ----------------------------------------------------------------

def _rope(cfg: Dict[str, Any]):
    """(theta, scaling) from either the transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` fields."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("rope_type" in params or "rope_theta" in params):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = dict(params)
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), {"type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        # Megatron's RotaryEmbedding(rope_scaling=True) hard-codes the Llama 3.1 constants.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in fixed.items():
            if float(scaling.get(key, want)) != want:
                raise UnsupportedModelError(
                    f"rope_scaling llama3 with {key}={scaling.get(key)}: Megatron's rope scaling "
                    f"supports only {key}={want}"
                )
        return float(theta), {"type": "llama3", "factor": float(scaling["factor"])}
    raise UnsupportedModelError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3); "
        "block-diffusion rotary embeddings use Megatron's RotaryEmbedding"
    )


def _refuse_if(condition: bool, what: str) -> None:
    if condition:
        raise UnsupportedModelError(what)


def shape_from_hf_config(cfg: Dict[str, Any], params_dtype: Optional[str] = None) -> ModelShape:
    """Translate a Hugging Face `config.json` dict; refuse what Megatron's layers cannot match."""
    from megatron_csbp.model.diffusiongemma import provider as diffusion_gemma

    if diffusion_gemma.is_source(cfg):
        return diffusion_gemma.shape_from_hf_config(cfg, params_dtype)
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"Hugging Face model_type {model_type!r} (architectures {archs}) is not supported; "
            f"supported: {sorted(ARCHITECTURES)} and DiffusionGemma / Gemma 4 text MoE"
        )
    for arch in archs:
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported (only causal LMs: {sorted(ARCHITECTURES)})"
            )
    act = cfg.get("hidden_act", "silu")
    _refuse_if(act != "silu", f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
    _refuse_if(cfg.get("attention_bias", False) and family in ("llama", "mixtral"),
               "attention_bias=True (bias on o_proj too) is not supported: Megatron adds q/k/v bias only")
    _refuse_if(cfg.get("mlp_bias", False), "mlp_bias=True is not supported (add_bias_linear=False)")
    _refuse_if(float(cfg.get("attention_dropout", 0.0) or 0.0) != 0.0,
               f"attention_dropout={cfg.get('attention_dropout')} is not supported with block diffusion")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        _refuse_if(bool(cfg.get("use_sliding_window", False)),
                   "use_sliding_window=True (sliding-window layers of Qwen) is not supported by the converter")
    if family == "mixtral":
        _refuse_if(cfg.get("sliding_window") is not None,
                   f"sliding_window={cfg.get('sliding_window')} (Mistral sliding-window attention) is not supported")
    hybrid = family == "qwen3_5"
    allowed_layers = {"full_attention", "linear_attention"} if hybrid else {"full_attention"}
    _refuse_if(cfg.get("layer_types") is not None and any(t not in allowed_layers for t in cfg["layer_types"]),
               f"layer_types {sorted(set(cfg.get('layer_types') or []))}: only {sorted(allowed_layers)} layers "
               f"are supported for {family}")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    groups = int(cfg.get("num_key_value_heads") or heads)
    _refuse_if(heads % groups != 0, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    head_dim = cfg.get("head_dim") or hidden // heads
    theta, scaling = _rope(cfg)
    partial = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    _refuse_if(partial not in (None, 1.0) and not hybrid, f"partial_rotary_factor={partial} is not supported")
    dtype = params_dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    _refuse_if(dtype not in DTYPES, f"dtype {dtype!r} is not supported (one of {sorted(DTYPES)})")
    shape = ModelShape(
        family=family,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=int(head_dim),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        rotary_base=theta,
        rope_scaling=scaling,
        add_qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_layernorm=family in ("qwen3", "qwen3_moe", "qwen3_5"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        params_dtype=dtype,
        hf_config=dict(cfg),
    )
    if hybrid:
        from megatron_csbp.model.hybrid import linear_attention_pattern

        # Text positions are the same on the three M-RoPE axes, so M-RoPE is plain RoPE here.
        shape.gated_delta = dict(
            pattern=linear_attention_pattern(shape.num_layers, layer_types=cfg["layer_types"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            key_head_dim=int(cfg["linear_key_head_dim"]), value_head_dim=int(cfg["linear_value_head_dim"]),
            num_key_heads=int(cfg["linear_num_key_heads"]), num_value_heads=int(cfg["linear_num_value_heads"]))
        _refuse_if(shape.gated_delta["num_value_heads"] % shape.gated_delta["num_key_heads"] != 0,
                   "linear_num_value_heads must be a multiple of linear_num_key_heads")
        shape.attention_output_gate = True
        shape.rotary_percent = float(partial or 1.0)
        shape.zero_centered_norms = True
    if family == "qwen3_moe":
        experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
        step = int(cfg.get("decoder_sparse_step", 1))
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        pattern = [int(i not in mlp_only and experts > 0 and (i + 1) % step == 0) for i in range(shape.num_layers)]
        shape.num_experts = experts
        shape.moe_router_topk = int(cfg["num_experts_per_tok"])
        shape.moe_ffn_hidden_size = int(cfg["moe_intermediate_size"])
        # softmax over all experts then top-k; renormalising the top-k (norm_topk_prob) is the same
        # as top-k of the logits followed by a softmax over them.
        shape.moe_router_pre_softmax = not bool(cfg.get("norm_topk_prob", False))
        shape.moe_layer_pattern = None if all(pattern) else pattern
        _refuse_if(not any(pattern), "Qwen3-MoE config without any MoE layer: convert it as qwen3")
    elif family == "mixtral":
        shape.num_experts = int(cfg["num_local_experts"])
        shape.moe_router_topk = int(cfg["num_experts_per_tok"])
        shape.moe_ffn_hidden_size = int(cfg["intermediate_size"])
        shape.moe_router_pre_softmax = False  # top-k of the logits, softmax over the k
        jitter = float(cfg.get("router_jitter_noise", 0.0) or 0.0)
        shape.moe_input_jitter_eps = jitter or None
    if shape.is_moe:
        _refuse_if(shape.moe_router_topk > shape.num_experts,
                   f"num_experts_per_tok {shape.moe_router_topk} > number of experts {shape.num_experts}")
    return shape


# ---- shape -> Megatron ---------------------------------------------------------------------------

#: What every model the plugin builds from a checkpoint shares: no dropout (the loss must not depend
#: on the layout), no fused kernels (they need CUDA, TransformerEngine or Apex, and exactness is
#: checked against unfused math), weights created on CPU.
PORTABLE_CONFIG = dict(
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    use_cpu_initialization=True,
)


def transformer_config(shape: ModelShape, params_dtype: Optional[torch.dtype] = None, **overrides):
    """The megatron-core `TransformerConfig` of `shape`. `overrides` set parallelism and training
    options (tensor_model_parallel_size, sequence_parallel, recompute, ...)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if shape.family == "diffusion_gemma":
        from megatron_csbp.model.diffusiongemma import provider as diffusion_gemma

        return diffusion_gemma.transformer_config(shape, params_dtype, **overrides)
    dtype = params_dtype or shape.torch_dtype
    kwargs = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.add_qkv_bias,
        qk_layernorm=shape.qk_layernorm,
        **PORTABLE_CONFIG,
        # weights are loaded from a checkpoint; pass perform_initialization=True to draw them
        perform_initialization=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )
    if shape.gated_delta is not None:
        gd = shape.gated_delta
        kwargs.update(linear_conv_kernel_dim=gd["conv_kernel"], linear_key_head_dim=gd["key_head_dim"],
                      linear_value_head_dim=gd["value_head_dim"], linear_num_key_heads=gd["num_key_heads"],
                      linear_num_value_heads=gd["num_value_heads"],
                      # megatron's own hybrid pattern knob: also makes dist_checkpointing store the
                      # layers one by one (non-homogeneous), as their parameters differ
                      linear_attention_freq=list(gd["pattern"]))
    if shape.attention_output_gate:
        kwargs.update(attention_output_gate=True)
    if shape.is_moe:
        kwargs.update(
            num_moe_experts=shape.num_experts,
            moe_router_topk=shape.moe_router_topk,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_pre_softmax=shape.moe_router_pre_softmax,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            # allgather runs on CPU without streams; any dispatcher reads the same checkpoint
            moe_token_dispatcher_type="allgather",
            moe_layer_freq=shape.moe_layer_pattern if shape.moe_layer_pattern is not None else 1,
            moe_input_jitter_eps=shape.moe_input_jitter_eps,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(shape: ModelShape, config=None, block_diffusion: bool = True, kernel: str = "auto"):
    """Megatron local layer spec of `shape` (a decoder block spec when dense and MoE layers mix),
    with the block-diffusion core attention (attention kernel `kernel`: --attention-kernel) swapped
    in unless `block_diffusion=False`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if shape.gated_delta is not None:
        if shape.is_moe:
            raise UnsupportedModelError("hybrid Gated DeltaNet models with MoE layers are not supported")
        from megatron_csbp.model.hybrid import hybrid_block_spec

        spec = hybrid_block_spec(shape.gated_delta["pattern"], qk_layernorm=shape.qk_layernorm,
                                 zero_centered_norms=shape.zero_centered_norms)
        if not block_diffusion:
            raise UnsupportedModelError("hybrid Gated DeltaNet models are built with block-diffusion layers only")
        return spec
    if shape.is_moe and shape.moe_layer_pattern is not None:
        if config is None:
            raise ValueError("a mixed dense/MoE layer pattern needs the TransformerConfig")
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=shape.num_experts if shape.is_moe else None,
            moe_grouped_gemm=False,
            qk_layernorm=shape.qk_layernorm,
            normalization="RMSNorm",
        )
    if block_diffusion:
        from megatron_csbp.model.spec import with_block_diffusion_attention

        spec = with_block_diffusion_attention(spec, kernel=kernel)
    return spec


def rotary_kwargs(shape: ModelShape) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = dict(position_embedding_type="rope", rotary_percent=shape.rotary_percent, rotary_base=int(shape.rotary_base)
                                  if float(shape.rotary_base).is_integer() else shape.rotary_base)
    if shape.rope_scaling is not None:
        if shape.rope_scaling["type"] == "llama3":
            kwargs.update(rope_scaling=True, rope_scaling_factor=shape.rope_scaling["factor"])
        elif shape.rope_scaling["type"] == "linear":
            kwargs.update(seq_len_interpolation_factor=shape.rope_scaling["factor"])
        else:  # guarded by shape_from_hf_config; a hand-edited file lands here
            raise UnsupportedModelError(f"rope scaling {shape.rope_scaling} is not supported")
    return kwargs


def build_gpt_model(shape: ModelShape, config=None, block_diffusion: bool = True, kernel: str = "auto",
                    **config_overrides):
    """A megatron-core `GPTModel` of `shape` (parallel state must be initialised). The vocabulary is
    exactly `shape.vocab_size` (no padding: TP must divide it). `kernel`: the block-diffusion
    attention kernel (--attention-kernel), for every model family.

    Weights are not initialised (they are about to be loaded); pass `perform_initialization=True`
    in `config_overrides` to draw them. Other overrides set parallelism and training options."""
    from megatron.core.models.gpt import GPTModel

    if shape.family == "diffusion_gemma":
        from megatron_csbp.model.diffusiongemma import provider as diffusion_gemma

        return diffusion_gemma.build_model(shape, config, block_diffusion, kernel=kernel, **config_overrides)
    if config is None:
        config = transformer_config(shape, **config_overrides)
    rotary = rotary_kwargs(shape)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(shape, config, block_diffusion, kernel=kernel),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        **rotary,
    )
    if not config.perform_initialization:
        mark_tensor_parallel_weights(model, config)
    return model


def mark_tensor_parallel_weights(model: torch.nn.Module, config) -> int:
    """Set the tensor-parallel attributes Megatron only sets while initialising weights.

    With `perform_initialization=False` (weights about to be loaded), megatron-core 0.16 leaves
    `tensor_model_parallel` / `partition_dim` / `partition_stride` unset on the weights of parallel
    linears and embeddings, so gradient-norm and optimizer code would treat TP-sharded weights as
    TP duplicates. This sets exactly what initialisation sets: dim 0 for column-parallel layers and
    the vocabulary embedding, dim 1 for row-parallel layers, stride 2 for SwiGLU `linear_fc1`.
    Returns the number of weights marked."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, set_tensor_model_parallel_attributes,
    )

    marked = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or getattr(weight, "tensor_model_parallel", False):
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            stride = 2 if (name.endswith("linear_fc1") and config.gated_linear_unit) else 1
            set_tensor_model_parallel_attributes(weight, True, 0, stride)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)
        else:
            continue
        marked += 1
    return marked


def megatron_flags(shape: ModelShape) -> List[str]:
    """Megatron-LM command-line flags that rebuild the same model (local spec)."""
    if shape.family == "diffusion_gemma":
        raise UnsupportedModelError(
            "DiffusionGemma has no Megatron-LM flag set (heterogeneous layers, K=V full layers, sandwich norms): "
            "build it with megatron_csbp.model.diffusiongemma.provider.build_model or train it with "
            "python -m megatron_csbp.train --load CHECKPOINT")
    if shape.gated_delta is not None:
        raise UnsupportedModelError(
            "hybrid Gated DeltaNet models have no Megatron-LM flag set here (Megatron-LM builds its GDN "
            "decoder with TransformerEngine only): train with python -m megatron_csbp.train --load CHECKPOINT")
    flags = [
        f"--num-layers {shape.num_layers}",
        f"--hidden-size {shape.hidden_size}",
        f"--ffn-hidden-size {shape.ffn_hidden_size}",
        f"--num-attention-heads {shape.num_attention_heads}",
        f"--kv-channels {shape.kv_channels}",
        f"--max-position-embeddings {shape.max_position_embeddings}",
        "--position-embedding-type rope",
        f"--rotary-base {int(shape.rotary_base)}",
        "--rotary-percent 1.0",
        "--normalization RMSNorm",
        f"--norm-epsilon {shape.norm_epsilon}",
        "--swiglu",
        "--disable-bias-linear",
        "--attention-dropout 0.0",
        "--hidden-dropout 0.0",
        f"--vocab-size {shape.vocab_size}",
        "--make-vocab-size-divisible-by 1",
        "--transformer-impl local",
        "--no-masked-softmax-fusion",
        "--no-bias-swiglu-fusion",
        "--no-rope-fusion",
    ]
    if shape.num_query_groups != shape.num_attention_heads:
        flags += ["--group-query-attention", f"--num-query-groups {shape.num_query_groups}"]
    if shape.add_qkv_bias:
        flags.append("--add-qkv-bias")
    if shape.qk_layernorm:
        flags.append("--qk-layernorm")
    if not shape.tie_word_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if shape.rope_scaling is not None:
        if shape.rope_scaling["type"] == "llama3":
            flags += ["--use-rope-scaling", f"--rope-scaling-factor {shape.rope_scaling['factor']}"]
        else:
            flags.append(f"--rotary-seq-len-interpolation-factor {shape.rope_scaling['factor']}")
    if shape.is_moe:
        flags += [
            f"--num-experts {shape.num_experts}",
            f"--moe-router-topk {shape.moe_router_topk}",
            f"--moe-ffn-hidden-size {shape.moe_ffn_hidden_size}",
            "--moe-router-score-function softmax",
            "--moe-router-load-balancing-type none",
        ]
        if shape.moe_router_pre_softmax:
            flags.append("--moe-router-pre-softmax")
        if shape.moe_layer_pattern is not None:
            flags.append(f"--moe-layer-freq \"([{','.join(map(str, shape.moe_layer_pattern))}])\"")
        if shape.moe_input_jitter_eps:
            flags.append(f"--moe-input-jitter-eps {shape.moe_input_jitter_eps}")
    flags.append("--bf16" if shape.params_dtype == "bfloat16" else "--fp16" if shape.params_dtype == "float16" else "")
    return [f for f in flags if f]
