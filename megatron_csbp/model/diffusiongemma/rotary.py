"""Two rotary tables in one Megatron `RotaryEmbedding`.

`GemmaRotaryTables` (sliding and "proportional" full tables, `inv_freq` concatenated),
`select_table` and `layer_rotary_angles`. Design: docs/diffusiongemma.md (the "two rotary tables" row).
"""
from __future__ import annotations

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_csbp.model.diffusiongemma.config import FULL, SLIDING


class GemmaRotaryTables(RotaryEmbedding):
    def __init__(self, config, cp_group=None):
        super().__init__(kv_channels=config.kv_channels, rotary_percent=1.0, rotary_interleaved=False,
                         rotary_base=config.rotary_base, use_cpu_initialization=True, cp_group=cp_group)
        if config.rotary_interleaved:
            raise ValueError("DiffusionGemma uses rotate-half rotary embeddings (rotary_interleaved=False)")
        sliding, full = config.rope_inv_freq(SLIDING), config.rope_inv_freq(FULL)
        self.half_dims = (sliding.numel(), full.numel())
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.inv_freq = torch.cat([sliding, full]).to(device)
        # `layer_rotary_angles` relies on the table being outer(position, inv_freq).
        assert self.seq_len_interpolation_factor is None


def select_table(emb: torch.Tensor, kind: str, half_dims) -> torch.Tensor:
    """The `kind` layers' rotary angles [.., d] out of the combined [.., 2 * (d_s/2 + d_f/2)] tensor."""
    hs, hf = half_dims
    if emb.shape[-1] != 2 * (hs + hf):
        raise RuntimeError(f"rotary tensor has {emb.shape[-1]} angles, expected 2 x ({hs} + {hf})")
    start, width = {SLIDING: (0, hs), FULL: (hs, hf)}[kind]  # its angles in each half of cat(F, F)
    half = hs + hf
    return torch.cat([emb[..., start : start + width], emb[..., half + start : half + start + width]], dim=-1)


def layer_rotary_angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[n, 1, 1, d] rotary angles of one layer kind (its `rope_inv_freq`) at `positions` [n].

    Bitwise what `select_table(LayoutRotaryEmbedding(GemmaRotaryTables)(...), kind)` holds for rows
    at those positions: Megatron's table is outer(arange, inv_freq) (one fp32 product per entry,
    no interpolation factor here) indexed by position, and the combined tensor is cat(F, F)."""
    freqs = torch.outer(positions.to(inv_freq.dtype), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
