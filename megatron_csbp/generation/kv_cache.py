"""Clean-prefix KV cache for block-diffusion decoding (BD3-LM and DiffusionGemma alike).

Clean rows never change once final, so each layer's `BlockDiffusionAttention` is wrapped
(`install`) with `extend` / `decode` / `off` modes over the project's one mask predicate.
`state.rows` is the mask's view of the rows (positions may be shifted); rotary positions come
from the plan. Modes and size: docs/training.md#generation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from megatron_csbp.layout.masks import BlockGeometry, RowMeta
from megatron_csbp.layout.rows import PartialMask


@dataclass
class CacheState:
    mode: str = "off"  # 'off' (training path) | 'extend' (clean rows -> cache) | 'decode' (noisy rows)
    rows: Optional[RowMeta] = None  # the mask's view of this call's rows
    geometry: Optional[BlockGeometry] = None
    kv: Dict[int, tuple] = field(default_factory=dict)  # layer -> (k, v, RowMeta of cached clean rows)

    def reset(self, geometry: BlockGeometry) -> None:
        self.mode, self.rows, self.geometry = "off", None, geometry
        self.kv.clear()


class CachedBlockAttention(torch.nn.Module):
    """Wraps a BlockDiffusionAttention: passes through in 'off' mode, uses the clean K/V cache otherwise."""

    def __init__(self, inner, state: CacheState):
        super().__init__()
        self.inner, self.state = inner, state

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        st = self.state
        if st.mode == "off":
            return self.inner(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        from megatron_csbp.attention.kernels.registry import get_kernel

        layer = self.inner.layer_number
        geometry = st.geometry.with_window(self.inner.window)
        k_meta = st.rows
        if layer in st.kv:  # the cached clean rows' keys first
            cached_key, cached_value, cached_rows = st.kv[layer]
            key, value = torch.cat([cached_key, key]), torch.cat([cached_value, value])
            k_meta = RowMeta.cat([cached_rows, k_meta])
        # Row vectors of this call's queries and cached + new keys; the layer's kernel (tiled on
        # CPU) never builds a [queries x keys] mask.
        mask = PartialMask.of(st.rows, k_meta, geometry).to(query.device)
        kernel = get_kernel(self.inner.kernel_for(query, value), query.device)  # the layer's choice (head dim, device)
        out, _ = kernel(query, key, value, mask, self.inner.softmax_scale)
        if st.mode == "extend":
            st.kv[layer] = (key.detach(), value.detach(), k_meta)
        sq, b, H, d = out.shape
        return out.reshape(sq, b, H * d)


def install(gpt, state: CacheState) -> int:
    """Wrap every BlockDiffusionAttention of `gpt` (once); returns how many are wrapped."""
    from megatron_csbp.attention.core_attention import BlockDiffusionAttention

    n = 0
    for module in gpt.modules():
        ca = getattr(module, "core_attention", None)
        if isinstance(ca, CachedBlockAttention):
            ca.state = state
            n += 1
        elif isinstance(ca, BlockDiffusionAttention):
            module.core_attention = CachedBlockAttention(ca, state)
            n += 1
    return n


class CachedDecoder:
    """What the BD3-LM and DiffusionGemma samplers share: `bdlm`'s block-diffusion attention wrapped
    over one `CacheState` (`install`), and the counted model call of one mode."""

    def __init__(self, bdlm):
        self.bdlm, self.state, self.forward_calls = bdlm, CacheState(), 0
        if install(bdlm.gpt, self.state) == 0:
            raise ValueError("the model has no block-diffusion attention to decode with")

    def _run(self, ids: torch.Tensor, rows: RowMeta, mode: str, shift: int = 0, **logits_options) -> torch.Tensor:
        """`bdlm.logits` of `rows` fed with `ids` in cache `mode` ('extend': clean rows into the cache;
        'decode': noisy rows over it; 'off': no cache); the mask sees the rows' positions + `shift`."""
        from megatron_csbp.attention.block_attention import AttentionPlan

        self.state.mode, self.state.rows = mode, RowMeta(rows.is_clean, rows.position + shift)
        self.forward_calls += 1
        return self.bdlm.logits(ids, AttentionPlan(self.state.geometry, rows), **logits_options)
