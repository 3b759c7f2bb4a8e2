"""DiffusionGemma transformer layer and its Megatron layer spec: Megatron's `TransformerLayer` with
Gemma's sandwich norms and the per-stream `layer_scalar` / `clean_layer_scalar`
(docs/diffusiongemma.md, the "sandwich norms" row).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from megatron_csbp.attention.plan_handles import local_is_clean
from megatron_csbp.model.diffusiongemma.attention import DiffusionGemmaSelfAttention
from megatron_csbp.model.diffusiongemma.moe import (DiffusionGemmaMoELayer, DiffusionGemmaMoESubmodules,
                                                    DiffusionGemmaRouter)
from megatron_csbp.model.diffusiongemma.norms import GemmaRMSNorm


def _sandwich_add(norm):
    """Replaces bias-dropout-add: residual + post_norm(x) (no bias, no dropout)."""

    def make(training, fused):
        def add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                raise ValueError("DiffusionGemma linears have no bias")
            return residual + norm(x)

        return add

    return make


@dataclass
class DiffusionGemmaLayerSubmodules(TransformerLayerSubmodules):
    post_attention_layernorm: Union[ModuleSpec, type] = IdentityOp
    post_feedforward_layernorm: Union[ModuleSpec, type] = IdentityOp


class DiffusionGemmaTransformerLayer(TransformerLayer):
    def __init__(self, config, submodules: DiffusionGemmaLayerSubmodules, **kwargs):
        # kwargs: TransformerLayer's other arguments (layer_number, hidden_dropout, pg_collection, vp_stage)
        super().__init__(config=config, submodules=submodules, **kwargs)
        if self.hidden_dropout:
            raise ValueError("hidden_dropout must be 0 for DiffusionGemma (sandwich norms replace bias-dropout-add)")

        def norm(spec):
            return build_module(spec, config=self.config, hidden_size=self.config.hidden_size,
                                eps=self.config.layernorm_epsilon)

        self.post_attention_layernorm = norm(submodules.post_attention_layernorm)
        self.post_feedforward_layernorm = norm(submodules.post_feedforward_layernorm)
        self.self_attn_bda = _sandwich_add(self.post_attention_layernorm)
        self.mlp_bda = _sandwich_add(self.post_feedforward_layernorm)
        dtype = self.config.params_dtype
        self.register_buffer("layer_scalar", torch.ones(1, dtype=dtype))  # noisy rows (HF decoder copy)
        self.register_buffer("clean_layer_scalar", torch.ones(1, dtype=dtype))  # clean rows (HF encoder copy)

    def forward(self, *args, **kwargs):
        output, context = super().forward(*args, **kwargs)
        attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        is_clean = local_is_clean(attention_mask, output.shape[0], self.config.sequence_parallel)
        if is_clean is None:
            scale = self.clean_layer_scalar
        else:
            scale = torch.where(is_clean.to(output.device)[:, None, None], self.clean_layer_scalar,
                                self.layer_scalar).to(output.dtype)
        return output * scale, context


def diffusion_gemma_layer_spec() -> ModuleSpec:
    """Spec of one DiffusionGemma layer (local Megatron linears). Per-layer head dims, KV heads and
    windows come from the config (`get_config_for_layer`). The core attention is Megatron's; apply
    `with_block_diffusion_attention` to train it as a block-diffusion LM."""
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    branch_norms = {f"{p}_{branch}_layernorm": GemmaRMSNorm for p in ("pre", "post") for branch in ("dense", "experts")}
    attention = SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                                        linear_proj=RowParallelLinear, q_layernorm=GemmaRMSNorm,
                                        k_layernorm=GemmaRMSNorm)
    return ModuleSpec(
        module=DiffusionGemmaTransformerLayer,
        submodules=DiffusionGemmaLayerSubmodules(
            input_layernorm=GemmaRMSNorm,
            self_attention=ModuleSpec(module=DiffusionGemmaSelfAttention, submodules=attention,
                                      params={"attn_mask_type": AttnMaskType.causal}),
            self_attn_bda=get_bias_dropout_add,  # replaced by the post-attention sandwich add
            post_attention_layernorm=GemmaRMSNorm,
            pre_mlp_layernorm=IdentityOp,  # the FFN block normalises each branch itself
            mlp=ModuleSpec(module=DiffusionGemmaMoELayer, submodules=DiffusionGemmaMoESubmodules(
                experts=ModuleSpec(module=SequentialMLP, submodules=linears), router=DiffusionGemmaRouter,
                dense=ModuleSpec(module=MLP, submodules=linears), **branch_norms)),
            mlp_bda=get_bias_dropout_add,  # replaced by the post-feedforward sandwich add
            post_feedforward_layernorm=GemmaRMSNorm,
        ),
    )


def diffusion_gemma_block_spec(config, block_diffusion: bool = True, kernel: str = "auto", vp_stage=None):
    """Decoder block spec of this pipeline stage (`vp_stage`: its virtual stage): every layer
    `diffusion_gemma_layer_spec()`, Gemma RMSNorm as the final norm; with the block-diffusion core
    attention swapped in unless `block_diffusion=False`."""
    layer = diffusion_gemma_layer_spec()
    spec = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=GemmaRMSNorm)
    if block_diffusion:
        from megatron_csbp.model.spec import with_block_diffusion_attention

        spec = with_block_diffusion_attention(spec, kernel=kernel)
    return spec
