"""The megatron-core constructors: `transformer_config(**fields)` and `gpt_model(config, layer_spec, ...)`,
which every caller goes through (the trainer's flag-built model, the demo, the benchmark, the
Megatron-LM model provider, the DFlash drafter, the model families). Each caller passes its own
fields; no defaults are added here, so each keeps exactly the config it had. This module sits below
model/families/ (which build through it); model/builder.py builds a `ModelShape` through its family.

`PORTABLE_CONFIG` holds what every model the plugin builds from a checkpoint shares.
"""
from __future__ import annotations

import math

import torch

from megatron_csbp.config.options import OPTIONS

#: What every model the plugin builds from a checkpoint shares: no dropout (the loss must not depend
#: on the layout), no fused kernels (they need CUDA, TransformerEngine or Apex, and exactness is
#: checked against unfused math), weights created on CPU.
PORTABLE_CONFIG = dict(
    hidden_dropout=0.0, attention_dropout=0.0,
    bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
    apply_rope_fusion=False, gradient_accumulation_fusion=False,
    use_cpu_initialization=True,
)
#: The routing every converted MoE shares: softmax top-k, no load balancing; allgather runs on CPU
#: without streams (any dispatcher reads the same checkpoint).
PORTABLE_MOE_CONFIG = dict(moe_router_score_function="softmax", moe_router_load_balancing_type="none",
                           moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")

#: The integer sizes a `TransformerConfig` shares by name with `ModelShape`, the trainer's
#: `ModelArgs` and Megatron configs (the options declared so, config/options.py).
DIMENSIONS = tuple(o.name for o in OPTIONS if o.shape and o.config == o.name and o.type is int and not o.moe)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """The padded vocabulary of a flag-built model: a multiple of lcm(--make-vocab-size-divisible-by,
    TP), so that TP never changes the model (Megatron-LM pads to a multiple of the flag x TP: the
    same at TP 1; docs/megatron-lm.md)."""
    multiple = math.lcm(divisible_by, tp)
    return int(math.ceil(vocab_size / multiple) * multiple)


def embedding_rows(a, shape=None) -> int:
    """The embedding's rows of the trainer's model (`a`: its flags or ModelArgs; `a.vocab_size` the
    tokenizer's vocabulary): a converted checkpoint's exact vocabulary (`shape`, else `a.model_shape`
    of ModelArgs), else the padded vocabulary of the flags. Mask ids are checked against it."""
    shape = shape if shape is not None else getattr(a, "model_shape", None)
    if shape is not None:
        return int(shape.vocab_size)
    return padded_vocab_size(a.vocab_size, a.make_vocab_size_divisible_by, a.tensor_model_parallel_size)


def dtype_fields(dtype) -> dict:
    """The config's weight dtype and its bf16 / fp16 switches."""
    return dict(params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)


def dimensions(source) -> dict:
    """{field: source.field} for the `DIMENSIONS`."""
    return {name: getattr(source, name) for name in DIMENSIONS}


def transformer_config(config_class=None, **fields):
    """A megatron-core `TransformerConfig` (or the subclass `config_class`, e.g. DiffusionGemmaConfig)
    with exactly `fields`."""
    if config_class is None:
        from megatron.core.transformer.transformer_config import TransformerConfig as config_class
    return config_class(**fields)


def local_layer_spec(block_diffusion: bool = True, kernel: str = "auto", **spec_options):
    """Megatron's local (torch) GPT layer spec (`get_gpt_layer_local_spec(**spec_options)`), with the
    block-diffusion core attention (attention kernel `kernel`: --attention-kernel) swapped in unless
    `block_diffusion=False`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(**spec_options)
    return with_block_diffusion(spec, kernel) if block_diffusion else spec


def gpt_layer_spec(config, mixed_moe: bool, block_diffusion: bool = True, kernel: str = "auto",
                   normalization: str = "RMSNorm", vp_stage=None, transformer_engine: bool = False, **layer_options):
    """The GPT layer spec of a flag-built or converted model, with the block-diffusion core attention
    unless `block_diffusion=False`: Megatron's decoder block spec when dense and MoE layers mix
    (`mixed_moe`; it reads the pattern from `config`, cut to this chunk's layers), else one layer spec
    for every layer (`layer_options`: num_experts, moe_grouped_gemm, qk_layernorm), local (torch) or
    TransformerEngine's (`transformer_engine`: Megatron-LM's --transformer-impl transformer_engine), as
    Megatron-LM's own GPT builder chooses."""
    from megatron.core.models.gpt import gpt_layer_specs

    if mixed_moe:
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=transformer_engine,
                                                          normalization=normalization, vp_stage=vp_stage)
    elif transformer_engine:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**layer_options)
    else:
        return local_layer_spec(block_diffusion, kernel, normalization=normalization, **layer_options)
    return with_block_diffusion(spec, kernel) if block_diffusion else spec


def with_block_diffusion(spec, kernel: str = "auto"):
    from megatron_csbp.model.spec import with_block_diffusion_attention

    return with_block_diffusion_attention(spec, kernel=kernel)


def gpt_model(config, layer_spec, vocab_size: int, max_sequence_length: int, **options):
    """A megatron-core `GPTModel` (parallel state must be initialised); `options` are GPTModel's
    keyword arguments (rotary, embedding tying, pre/post process ...)."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=vocab_size,
                    max_sequence_length=max_sequence_length, **options)
