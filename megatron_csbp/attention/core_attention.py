"""`BlockDiffusionAttention`: a drop-in for Megatron's `core_attention` slot.

Megatron calls core attention with (query, key, value, attention_mask, ...). The block-diffusion
model passes, as `attention_mask`, a tiny tensor carrying this forward's `AttentionPlan` (see
`plan_mask`). A tensor travels through every Megatron path unchanged, including full-layer
activation recompute, which saves and replays the layer's inputs: the recompute then sees the
same plan and replays the same collectives.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_csbp.attention.block_attention import AttentionPlan, block_diffusion_attention
from megatron_csbp.attention.kernels import get_kernel

_PLAN_ATTR = "_block_diffusion_plan"


def plan_mask(plan: AttentionPlan) -> torch.Tensor:
    """A placeholder tensor for Megatron's `attention_mask` argument that carries `plan`."""
    handle = torch.zeros(1, dtype=torch.bool)
    setattr(handle, _PLAN_ATTR, plan)
    return handle


def plan_from_mask(attention_mask) -> AttentionPlan:
    plan = getattr(attention_mask, _PLAN_ATTR, None)
    if plan is None:
        raise RuntimeError(
            "BlockDiffusionAttention got an ordinary attention mask. Run the model through "
            "megatron_csbp.model.BlockDiffusionModel, which passes the block layout as the mask."
        )
    return plan


def layer_window(config, layer_number: int) -> Optional[int]:
    """Sliding window W (keys q-W < k <= q) of this layer from Megatron's window settings."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, right = config.window_size
    if right not in (0, -1) and right is not None:
        raise ValueError(f"--window-size right side must be 0 for block diffusion, got {config.window_size}")
    return None if left is None or left < 0 else left + 1


class BlockDiffusionAttention(MegatronModule):
    """Block-aware core attention with the constructor and forward contract of Megatron's
    `DotProductAttention` / `TEDotProductAttention` (GQA included)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        kernel: str = "auto",
        **kwargs,
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError("block-diffusion attention supports self attention only")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"--attention-dropout must be 0 with block-diffusion attention (got {dropout}): "
                "dropout on attention probabilities would make the loss depend on the layout"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type {config.softmax_type!r} is not supported by block-diffusion attention")
        self.layer_number = max(1, layer_number)
        kv_channels = kwargs.get("k_channels") or config.kv_channels
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(kv_channels)
        if config.apply_query_key_layer_scaling:
            raise ValueError("--apply-query-key-layer-scaling is not supported by block-diffusion attention")
        self.softmax_scale = softmax_scale
        self.kernel_name = kernel
        self.window = layer_window(config, self.layer_number)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("packed sequences (THD) are not supported with block diffusion; pack to --seq-length")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by block-diffusion attention")
        plan = plan_from_mask(attention_mask)
        if query.shape[0] != len(plan.local):
            raise RuntimeError(
                f"core attention got {query.shape[0]} rows but the block layout has {len(plan.local)} on this rank"
            )
        kernel = get_kernel(self.kernel_name, query.device)
        out = block_diffusion_attention(
            query, key, value, plan,
            softmax_scale=self.softmax_scale, kernel=kernel, window=self.window, layer=self.layer_number,
        )
        sq, b, H, d = out.shape
        return out.reshape(sq, b, H * d)
