"""Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral: Megatron-core `GPTModel`s (local layer spec) that
reproduce the Hugging Face decoders exactly.

Supported: Llama (incl. Llama 3.x rope scaling), Qwen2 (q/k/v bias), Qwen3 (QK-norm), Qwen3-MoE and
Mixtral (Megatron MoE layers, `SequentialMLP` experts), tied or untied embeddings, GQA, rotary base
and linear / llama3 rope scaling. Anything else is refused with a message that names the option.

Megatron's local (torch) layer spec is used: RMSNorm (`torch.nn.RMSNorm`), SwiGLU
(`gated_linear_unit`, silu), no linear biases except the optional fused QKV bias.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_csbp.config.options import OPTIONS, flag_text, gpt_kwargs, moe_layer_pattern
from megatron_csbp.model import core
from megatron_csbp.model.families import get_family, register_family
from megatron_csbp.model.families.base import (
    Family, ModelShape, UnsupportedModelError, check_dtype, flag_values, refuse_if,
)

#: (module prefix, router name, (gate, up, down) expert weight names) of Hugging Face MoE layers
MLP_MOE_NAMES = ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))
#: the Llama 3.1 rope scaling constants Megatron's RotaryEmbedding(rope_scaling=True) hard-codes
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


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
        for key, want in LLAMA3_FIXED.items():
            refuse_if(float(scaling.get(key, want)) != want,
                      f"rope_scaling llama3 with {key}={scaling.get(key)}: Megatron's rope scaling "
                      f"supports only {key}={want}")
        return float(theta), {"type": "llama3", "factor": float(scaling["factor"])}
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3); "
                                "block-diffusion rotary embeddings use Megatron's RotaryEmbedding")


class GPTFamily(Family):
    """A decoder family built as a Megatron `GPTModel` with the local layer spec. The per-family
    differences are the constructor's options; subclasses add MoE (`_complete`) or other layers."""

    has_megatron_lm_flags = True
    #: Hugging Face `layer_types` entries accepted
    layer_types: Tuple[str, ...] = ("full_attention",)
    #: a partial_rotary_factor below 1 is reproduced (Megatron's rotary_percent)
    partial_rotary: bool = False

    def __init__(self, name: str, model_type: str, architecture: str, *, qkv_bias: bool = False,
                 qk_layernorm: bool = False, attention_bias_has_o_proj: bool = False,
                 refuse_use_sliding_window: bool = False, refuse_sliding_window: bool = False,
                 hf_moe_names=MLP_MOE_NAMES):
        self.name, self.model_types, self.architectures = name, (model_type,), (architecture,)
        #: q/k/v projections always carry a bias (Qwen2)
        self.qkv_bias = qkv_bias
        self.qk_layernorm = qk_layernorm
        #: `attention_bias=True` also puts a bias on o_proj (Llama, Mixtral): refused
        self.attention_bias_has_o_proj = attention_bias_has_o_proj
        self.refuse_use_sliding_window = refuse_use_sliding_window
        self.refuse_sliding_window = refuse_sliding_window
        self.hf_moe_names = hf_moe_names

    # ---- Hugging Face config -> shape --------------------------------------------------------
    def shape_from_hf_config(self, cfg: Dict[str, Any], params_dtype: Optional[str] = None) -> ModelShape:
        for arch in cfg.get("architectures") or []:
            refuse_if(arch not in self.architectures,
                      f"architecture {arch!r} is not supported (only causal LMs: {sorted(self.architectures)})")
        act = cfg.get("hidden_act", "silu")
        refuse_if(act != "silu", f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        refuse_if(cfg.get("attention_bias", False) and self.attention_bias_has_o_proj,
                  "attention_bias=True (bias on o_proj too) is not supported: Megatron adds q/k/v bias only")
        refuse_if(cfg.get("mlp_bias", False), "mlp_bias=True is not supported (add_bias_linear=False)")
        refuse_if(float(cfg.get("attention_dropout", 0.0) or 0.0) != 0.0,
                  f"attention_dropout={cfg.get('attention_dropout')} is not supported with block diffusion")
        refuse_if(self.refuse_use_sliding_window and bool(cfg.get("use_sliding_window", False)),
                  "use_sliding_window=True (sliding-window layers of Qwen) is not supported by the converter")
        refuse_if(self.refuse_sliding_window and cfg.get("sliding_window") is not None,
                  f"sliding_window={cfg.get('sliding_window')} (Mistral sliding-window attention) is not supported")
        layer_types = set(cfg.get("layer_types") or [])
        refuse_if(not layer_types <= set(self.layer_types), f"layer_types {sorted(layer_types)}: only "
                  f"{sorted(self.layer_types)} layers are supported for {self.name}")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        groups = int(cfg.get("num_key_value_heads") or heads)
        refuse_if(heads % groups != 0, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
        head_dim = cfg.get("head_dim") or hidden // heads
        theta, scaling = _rope(cfg)
        partial = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
        refuse_if(partial not in (None, 1.0) and not self.partial_rotary, f"partial_rotary_factor={partial} is not supported")
        dtype = check_dtype(params_dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        shape = ModelShape(
            family=self.name, num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden,
            ffn_hidden_size=int(cfg["intermediate_size"]), num_attention_heads=heads, num_query_groups=groups,
            kv_channels=int(head_dim), vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)), rotary_base=theta, rope_scaling=scaling,
            add_qkv_bias=self.qkv_bias or bool(cfg.get("attention_bias", False)), qk_layernorm=self.qk_layernorm,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), params_dtype=dtype, hf_config=dict(cfg),
        )
        self._complete(shape, cfg, partial)
        if shape.is_moe:
            refuse_if(shape.moe_router_topk > shape.num_experts,
                      f"num_experts_per_tok {shape.moe_router_topk} > number of experts {shape.num_experts}")
        return shape

    def _complete(self, shape: ModelShape, cfg: Dict[str, Any], partial_rotary) -> None:
        """Fill in the family's own fields (MoE, hybrid layers) from `cfg`."""

    # ---- shape -> Megatron -------------------------------------------------------------------
    def config_fields(self, shape: ModelShape, dtype: torch.dtype) -> Dict[str, Any]:
        """The shape's options with a TransformerConfig field (config/options.py), then the fixed ones."""
        flags = flag_values(shape)
        kwargs = {o.config: flags[o.name] for o in OPTIONS if o.shape and o.config and (shape.is_moe or not o.moe)}
        # weights are loaded from a checkpoint; pass perform_initialization=True to draw them
        kwargs.update(activation_func=F.silu, add_bias_linear=False, **core.PORTABLE_CONFIG,
                      perform_initialization=False, **core.dtype_fields(dtype),
                      **(core.PORTABLE_MOE_CONFIG if shape.is_moe else {}))
        return kwargs

    def transformer_config(self, shape: ModelShape, params_dtype: Optional[torch.dtype] = None, **overrides):
        return core.transformer_config(**(self.config_fields(shape, params_dtype or shape.torch_dtype) | overrides))

    def layer_spec(self, shape: ModelShape, config=None, block_diffusion: bool = True, kernel: str = "auto"):
        """Megatron local layer spec of `shape` (a decoder block spec when dense and MoE layers mix),
        with the block-diffusion core attention (attention kernel `kernel`: --attention-kernel) swapped
        in unless `block_diffusion=False`."""
        mixed_moe = shape.is_moe and shape.moe_layer_pattern is not None
        return core.gpt_layer_spec(config, mixed_moe, block_diffusion, kernel, qk_layernorm=shape.qk_layernorm,
                                   num_experts=shape.num_experts if shape.is_moe else None, moe_grouped_gemm=False)

    def build_model(self, shape: ModelShape, config, block_diffusion: bool = True, kernel: str = "auto", stage=None):
        from megatron_csbp.parallel.pipeline import WHOLE, stage_block_spec

        stage = stage or WHOLE
        return core.gpt_model(
            config, stage_block_spec(self.layer_spec(shape, config, block_diffusion, kernel=kernel), config, stage),
            vocab_size=shape.vocab_size,
            max_sequence_length=shape.max_position_embeddings,
            **stage.kwargs(),
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            **gpt_kwargs(SimpleNamespace(**flag_values(shape))),  # rotary: the flag-built model's route
        )

    # ---- weights -----------------------------------------------------------------------------
    def hf_to_megatron(self, shape, tensors, cfg):
        from megatron_csbp.model.families.gpt_weights import hf_to_megatron

        return hf_to_megatron(shape, tensors), {}

    def megatron_to_hf(self, shape, state):
        from megatron_csbp.model.families.gpt_weights import megatron_to_hf

        return dict(shape.hf_config), megatron_to_hf(shape, state), ()

    def megatron_flags(self, shape: ModelShape) -> List[str]:
        """Megatron-LM command-line flags that rebuild the same model (local spec): the shape's
        `flag_values` and the fixed ones, each written as config/options.py declares it."""
        from megatron_csbp.data.megatron_data import null_tokenizer_vocab_flag

        v = dict(flag_values(shape), add_bias_linear=False, attention_dropout=0.0,
                 hidden_dropout=0.0, make_vocab_size_divisible_by=1, transformer_impl="local",
                 masked_softmax_fusion=False, bias_swiglu_fusion=False, apply_rope_fusion=False,
                 group_query_attention=shape.num_query_groups != shape.num_attention_heads,
                 moe_router_score_function="softmax", moe_router_load_balancing_type="none",
                 bf16=shape.params_dtype == "bfloat16", fp16=shape.params_dtype == "float16",
                 # NullTokenizer (Megatron-LM's, the default for pre-tokenized data): the --vocab-size whose
                 # tokenizer has the model's rows exactly (no padding; megatron-core 0.16: rows - 1, 0.19: rows)
                 vocab_size=null_tokenizer_vocab_flag(shape.vocab_size))
        skip = {"rope_scaling_factor": not v["use_rope_scaling"], "moe_layer_freq": shape.moe_layer_pattern is None,
                "moe_input_jitter_eps": not shape.moe_input_jitter_eps,
                **dict.fromkeys(("group_query_attention", "num_query_groups"), not v["group_query_attention"])}
        printed = (o.name for o in OPTIONS if o.name in v and not skip.get(o.name) and (shape.is_moe or not o.moe))
        return [t for t in (flag_text(k, v[k]) for k in printed if v[k] is not None) if t]


class Qwen3MoeFamily(GPTFamily):
    trainer_trains_moe = True

    def _complete(self, shape, cfg, partial_rotary):
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
        refuse_if(not any(pattern), "Qwen3-MoE config without any MoE layer: convert it as qwen3")


class MixtralFamily(GPTFamily):
    trainer_trains_moe = True

    def _complete(self, shape, cfg, partial_rotary):
        shape.num_experts = int(cfg["num_local_experts"])
        shape.moe_router_topk = int(cfg["num_experts_per_tok"])
        shape.moe_ffn_hidden_size = int(cfg["intermediate_size"])
        shape.moe_router_pre_softmax = False  # top-k of the logits, softmax over the k
        jitter = float(cfg.get("router_jitter_noise", 0.0) or 0.0)
        shape.moe_input_jitter_eps = jitter or None


register_family(GPTFamily("llama", "llama", "LlamaForCausalLM", attention_bias_has_o_proj=True))
register_family(GPTFamily("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True, refuse_use_sliding_window=True))
register_family(GPTFamily("qwen3", "qwen3", "Qwen3ForCausalLM", qk_layernorm=True, refuse_use_sliding_window=True))
register_family(Qwen3MoeFamily("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", qk_layernorm=True,
                               refuse_use_sliding_window=True))
register_family(MixtralFamily("mixtral", "mixtral", "MixtralForCausalLM", attention_bias_has_o_proj=True,
                              refuse_sliding_window=True,
                              hf_moe_names=("block_sparse_moe", "gate", ("w1", "w3", "w2"))))


# ---- a flag-built model (python -m megatron_csbp.train without --load of a converted model) -----

#: Defaults of the `bdlm_meta.json` "model_args" keys older checkpoints lack (those saved since the
#: export): the saved options' declared defaults (the trainer's when those checkpoints were written),
#: and of the two keys the trainer derives (the weights' dtype, the padded vocabulary)
FLAG_DEFAULTS = dict({o.name: o.default for o in OPTIONS if o.saved}, params_dtype="float32", padded_vocab_size=None)

#: Hugging Face model type of a flag-built model: (MoE, --qk-layernorm, --add-qkv-bias) -> model_type
_FLAG_MODEL_TYPES = {(False, False, False): "llama", (False, True, False): "qwen3", (False, False, True): "qwen2",
                     (True, True, False): "qwen3_moe", (True, False, False): "mixtral"}


def hf_config_of_flags(model_args: Dict[str, Any]) -> Dict[str, Any]:
    """The Hugging Face `config.json` of the trainer's flag-built GPT (`model_args`: the saved
    `bdlm_meta.json` "model_args", the trainer's model flags by dest name): `LlamaForCausalLM`;
    `Qwen3ForCausalLM` with --qk-layernorm; `Qwen2ForCausalLM` with --add-qkv-bias; with
    --num-experts `MixtralForCausalLM` / `Qwen3MoeForCausalLM` (--qk-layernorm). Refuses, naming the
    flag, what none of them holds. The vocabulary is the trainer's padded one (the embedding's rows)."""
    a = dict(FLAG_DEFAULTS, **{k: v for k, v in model_args.items() if v is not None})
    for flag, ok, why in (
            ("--normalization LayerNorm", a["normalization"] == "RMSNorm", "they use RMSNorm"),
            ("--no-swiglu", a["swiglu"], "they use SwiGLU"),
            ("--add-bias-linear", not a["add_bias_linear"], "none has biases on o_proj and the MLP"),
            (f"--position-embedding-type {a['position_embedding_type']}", a["position_embedding_type"] == "rope",
             "they use rotary embeddings"),
            (f"--rotary-percent {a['rotary_percent']}", a["rotary_percent"] == 1.0, "they rotate every head dimension"),
            ("--qk-layernorm with --add-qkv-bias", not (a["qk_layernorm"] and a["add_qkv_bias"]),
             "Qwen3 has no q/k/v bias, Qwen2 no QK-norm"),
            ("--add-qkv-bias with --num-experts", not (a["add_qkv_bias"] and a["num_experts"]),
             "Mixtral and Qwen3-MoE have no q/k/v bias"),
            (f"--moe-router-score-function {a['moe_router_score_function']}",
             a["moe_router_score_function"] == "softmax", "their routers use softmax")):
        if not ok:
            raise UnsupportedModelError(f"the checkpoint's model was built with {flag}: it has no Hugging Face class "
                                        f"(LlamaForCausalLM, Qwen2/Qwen3ForCausalLM, Mixtral, Qwen3-MoE: {why})")
    moe = bool(a["num_experts"])
    model_type = _FLAG_MODEL_TYPES[(moe, bool(a["qk_layernorm"]), bool(a["add_qkv_bias"]))]
    heads = int(a["num_attention_heads"])
    a.update(num_query_groups=a["num_query_groups"] or heads, kv_channels=a["kv_channels"] or int(a["hidden_size"]) // heads,
             max_position_embeddings=a["max_position_embeddings"] or a["seq_length"])
    divisible_by = int(a["make_vocab_size_divisible_by"])
    vocab = a["padded_vocab_size"] or core.padded_vocab_size(int(a["vocab_size"]), divisible_by, 1)
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": float(a["rotary_base"])}
    if a["use_rope_scaling"]:
        rope.update(rope_type="llama3", factor=float(a["rope_scaling_factor"]), **LLAMA3_FIXED)
    elif a["rotary_seq_len_interpolation_factor"]:
        rope.update(rope_type="linear", factor=float(a["rotary_seq_len_interpolation_factor"]))
    # the options declared with a Hugging Face key (config/options.py), then what the flags imply
    cfg: Dict[str, Any] = {o.hf: (o.type or bool)(a[o.name]) for o in OPTIONS if o.hf and a[o.name] is not None}
    cfg.update(model_type=model_type, architectures=list(get_family(model_type).architectures), vocab_size=int(vocab),
               hidden_act="silu", rope_parameters=rope, tie_word_embeddings=not a["untie_embeddings_and_output_weights"],
               attention_dropout=0.0, dtype=a["params_dtype"])
    if model_type == "llama":
        cfg["mlp_bias"] = False
    if get_family(model_type).refuse_use_sliding_window:  # Qwen's sliding-window switch, off
        cfg["use_sliding_window"] = False
    if moe:
        cfg["num_experts_per_tok"] = int(a["moe_router_topk"])
        ffn = int(a["moe_ffn_hidden_size"] or a["ffn_hidden_size"])
        pattern = moe_layer_pattern(a["moe_layer_freq"], cfg["num_hidden_layers"])
        if model_type == "qwen3_moe":
            # norm_topk_prob=True: softmax over the top-k logits (Megatron without --moe-router-pre-softmax)
            if a["moe_input_jitter_eps"]:
                raise UnsupportedModelError("the checkpoint's model was built with --moe-input-jitter-eps and "
                                            "--qk-layernorm: Qwen3-MoE has no router jitter")
            cfg.update(num_experts=int(a["num_experts"]), moe_intermediate_size=ffn,
                       norm_topk_prob=not a["moe_router_pre_softmax"], decoder_sparse_step=1,
                       mlp_only_layers=[i for i, m in enumerate(pattern) if not m])
        else:
            for flag, ok in (("--moe-router-pre-softmax", not a["moe_router_pre_softmax"]),
                             (f"--moe-layer-freq {a['moe_layer_freq']}", all(pattern))):
                if not ok:
                    raise UnsupportedModelError(f"the checkpoint's model was built with {flag}: MixtralForCausalLM "
                                                "has every layer MoE with top-k-then-softmax routing (add "
                                                "--qk-layernorm for a Qwen3-MoE, which holds it)")
            cfg.update(num_local_experts=int(a["num_experts"]), intermediate_size=ffn,
                       router_jitter_noise=float(a["moe_input_jitter_eps"] or 0.0))
    return cfg


def shape_of_flags(model_args: Dict[str, Any]) -> ModelShape:
    """The `ModelShape` of the trainer's flag-built GPT: its Hugging Face config read by the family
    that owns it, so the converter's rules and refusals apply unchanged."""
    from megatron_csbp.model.families import shape_from_hf_config

    return shape_from_hf_config(hf_config_of_flags(model_args))
