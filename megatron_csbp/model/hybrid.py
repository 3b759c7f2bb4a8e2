"""Hybrid layer specs: Gated DeltaNet (linear attention) and block-aware softmax attention layers,
megatron-core's TE-only hybrid construction on the local backend, in the checkpoint's layer
pattern (docs/semantics.md#gated-deltanet-layers-attentiongated_deltapy-modelhybridpy).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_csbp.attention.gated_delta import BlockDiffusionGatedDeltaNet


def linear_attention_pattern(num_layers: int, *, layer_types: Optional[Sequence[str]] = None,
                             full_attention_interval: Optional[int] = None,
                             linear_attention_freq: Union[int, List[int], None] = None) -> List[int]:
    """Per layer: 1 = Gated DeltaNet, 0 = softmax attention. Exactly one source must be given."""
    given = [x is not None for x in (layer_types, full_attention_interval, linear_attention_freq)]
    if sum(given) != 1:
        raise ValueError("give exactly one of layer_types, full_attention_interval, linear_attention_freq")
    if layer_types is not None:
        bad = sorted(set(layer_types) - {"linear_attention", "full_attention"})
        if bad:
            raise ValueError(f"layer_types {bad}: only linear_attention and full_attention layers are supported")
        pattern = [int(t == "linear_attention") for t in layer_types]
    elif full_attention_interval is not None or isinstance(linear_attention_freq, int):
        name, every = (("full_attention_interval", full_attention_interval) if linear_attention_freq is None
                       else ("linear_attention_freq", linear_attention_freq))
        if int(every) < 1:
            raise ValueError(f"{name} must be >= 1, got {every}")
        pattern = [int((i + 1) % int(every) != 0) for i in range(num_layers)]
    else:
        pattern = [int(x) for x in linear_attention_freq]
    if len(pattern) != num_layers:
        raise ValueError(f"the linear-attention pattern has {len(pattern)} entries for {num_layers} layers")
    return pattern


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm that scales by (1 + w), w initialised to 0 (Qwen3.5 / Qwen3-Next `RMSNorm`), computed
    in fp32 like the Hugging Face reference: checkpoints keep w itself, bit for bit. Megatron's
    `layernorm_zero_centered_gamma` is refused by its torch norm, and GDN's own out_norm is a
    plain RMSNorm, so the zero-centred norms are chosen by the spec, not by the config."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.config, self.eps = config, eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # under sequence parallelism each TP rank sees its rows only: gradients are summed over TP
        # by finalize_model_grads, as for Megatron's norms
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x):
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = x.to(compute)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(compute))).to(x.dtype)


def gated_delta_net_spec() -> ModuleSpec:
    norm = LocalSpecProvider().layer_norm(rms_norm=True)
    return ModuleSpec(module=BlockDiffusionGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear))


def hybrid_block_spec(pattern: Sequence[int], qk_layernorm: bool = False, kernel: str = "auto",
                      zero_centered_norms: bool = False) -> TransformerBlockSubmodules:
    """Decoder block spec: layer i is Gated DeltaNet where pattern[i] == 1, block-aware attention
    (local spec, RMSNorm, SwiGLU-ready MLP) where 0. `zero_centered_norms`: the layer, QK and final
    norms scale by (1 + w) (`ZeroCenteredRMSNorm`); GDN's gated out_norm stays a plain RMSNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_csbp.lora.spec import active_transform
    from megatron_csbp.model.spec import with_block_diffusion_attention

    attention_layer = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    final_norm = LocalSpecProvider().layer_norm(rms_norm=True)
    if zero_centered_norms:
        sub = attention_layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = final_norm = ZeroCenteredRMSNorm
        if qk_layernorm:
            sub.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
            sub.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    norm = attention_layer.submodules.input_layernorm
    gdn_layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=gated_delta_net_spec(), self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=attention_layer.submodules.pre_mlp_layernorm, mlp=attention_layer.submodules.mlp,
        mlp_bda=get_bias_dropout_add))
    if 0 in pattern:
        attention_layer = with_block_diffusion_attention(attention_layer, kernel)
    gdn_layer = active_transform(gdn_layer)  # its MLP's LoRA adapters (the attention layer's come with the swap)
    layers = [gdn_layer if p else attention_layer for p in pattern]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)


def count_gated_delta_layers(model) -> int:
    return sum(isinstance(m, BlockDiffusionGatedDeltaNet) for m in model.modules())
