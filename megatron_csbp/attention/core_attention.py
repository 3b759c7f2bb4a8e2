"""`BlockDiffusionAttention`: a drop-in for Megatron's `core_attention` slot.

The plan arrives as the `attention_mask` tensor (`plan_handles.plan_mask`), a `KVSource` on the
`value` tensor (`plan_handles.with_kv_source`); why tensors (they survive recompute):
docs/architecture.md#one-ranks-attention-attention.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core.transformer.module import MegatronModule

from megatron_csbp.attention.block_attention import block_diffusion_attention
from megatron_csbp.attention.kernels.capability import choose
from megatron_csbp.attention.kernels.registry import get_kernel
from megatron_csbp.attention.plan_handles import kv_source_of, layer_window, plan_from_mask


class BlockDiffusionAttention(MegatronModule):
    """Block-aware core attention with the constructor and forward contract of Megatron's
    `DotProductAttention` / `TEDotProductAttention` (GQA included)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, kernel: str = "auto", **kwargs):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError("block-diffusion attention supports self attention only")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"--attention-dropout must be 0 with block-diffusion attention (got {dropout}): "
                             "dropout on attention probabilities would make the loss depend on the layout")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type {config.softmax_type!r} is not supported by block-diffusion attention")
        self.layer_number = max(1, layer_number)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(kwargs.get("k_channels") or config.kv_channels)
        if config.apply_query_key_layer_scaling:
            raise ValueError("--apply-query-key-layer-scaling is not supported by block-diffusion attention")
        self.softmax_scale = softmax_scale
        self.kernel_name = kernel
        self.window = layer_window(config, self.layer_number)

    def kernel_for(self, query: torch.Tensor, value: torch.Tensor) -> str:
        """The kernel of this layer's call: --attention-kernel, or for 'auto' the capability table's
        choice for its head dim, dtype and device (`kernels.capability.choose`)."""
        backward = torch.is_grad_enabled() and (query.requires_grad or value.requires_grad)
        return choose(self.kernel_name, query.device, max(query.shape[-1], value.shape[-1]), query.dtype, backward)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs) -> torch.Tensor:
        # megatron-core 0.19 may pass extra keywords (MLA); none of them can be honoured here.
        unsupported = sorted(k for k, v in kwargs.items() if v is not None)
        if unsupported:
            raise ValueError(f"block-diffusion attention does not support {unsupported}")
        if packed_seq_params is not None:
            raise ValueError("packed sequences (THD) are not supported with block diffusion; pack to --seq-length")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by block-diffusion attention")
        plan = plan_from_mask(attention_mask)
        if query.shape[0] != plan.num_query_rows:
            raise RuntimeError(f"core attention got {query.shape[0]} rows but the block layout has "
                               f"{plan.num_query_rows} on this rank")
        kernel = get_kernel(self.kernel_for(query, value), query.device)
        out = block_diffusion_attention(query, key, value, plan, softmax_scale=self.softmax_scale, kernel=kernel,
                                        window=self.window, layer=self.layer_number, kv_source=kv_source_of(value))
        sq, b, H, d = out.shape
        return out.reshape(sq, b, H * d)
