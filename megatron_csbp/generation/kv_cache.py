"""Clean-prefix KV cache for block-diffusion decoding (BD3-LM and DiffusionGemma alike).

Clean rows attend only to clean rows at or before them, so their keys and values never change once
a token is final. Each layer's `BlockDiffusionAttention` is wrapped (`install`): in `extend` mode
the call's rows are new clean rows, run once, their K/V appended to the layer's cache; in `decode`
mode the rows are the current block's noisy rows, which attend to [cached clean K/V ; their own
K/V]. The mask is the project's one predicate (`PartialMask.of` over `state.rows` and the cached
rows' metadata under `state.geometry` with the layer's window), so decoding attends exactly as
training does. In `off` mode the wrapper passes through (the training code path, no cache).

`state.rows` is the mask's view of the rows: DiffusionGemma's canvases start right after a prompt
of any length, so its sampler shifts mask positions by a constant to put canvases on block
boundaries (every rule of the predicate but the block boundaries is shift-invariant); the rotary
positions come from the plan the model is called with, never from here.

Size: the cache holds K and V of every clean row per layer, [rows, b, G, d] each (for a 256K
prefix of a 26B-A4B DiffusionGemma in bf16: per row 25 sliding layers x 2 x 8 x 256 + 5 full layers
x 2 x 2 x 512 values x 2 bytes = 220 KiB, 55 GiB for 256K rows; the full layers' K = V source is
stored as K and V; sliding layers could keep only their last W - 1 rows, not done here). A decoding step costs one forward of the block's B rows.
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
        cached = st.kv.get(layer)
        if cached is not None:
            k_all = torch.cat([cached[0], key], 0)
            v_all = torch.cat([cached[1], value], 0)
            k_meta = RowMeta.cat([cached[2], st.rows])
        else:
            k_all, v_all, k_meta = key, value, st.rows
        # Row vectors of this call's queries and cached + new keys; the layer's kernel (tiled on
        # CPU) never builds a [queries x keys] mask.
        mask = PartialMask.of(st.rows, k_meta, geometry).to(query.device)
        kernel = get_kernel(self.inner.kernel_name, query.device)
        out, _ = kernel(query, k_all, v_all, mask, self.inner.softmax_scale)
        if st.mode == "extend":
            st.kv[layer] = (k_all.detach(), v_all.detach(), k_meta)
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
