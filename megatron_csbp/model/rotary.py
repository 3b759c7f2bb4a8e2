"""Rotary embeddings indexed by the layout's positions.

Megatron's RotaryEmbedding ignores position ids and slices by its own zigzag CP layout. Block
layouts reorder rows (and noisy and clean copies of a token share one position), so the angles
must come from each row's position. This wrapper keeps Megatron's frequencies (rope scaling,
interpolation) and only changes which positions are used.

The angles are Megatron's (fp32 products), handed out in `dtype` (the model's compute dtype): an
fp64 model then takes cos/sin in fp64, whose rounding does not depend on how many rows a rank
holds (fp32 cos/sin, vectorised over a layout-dependent row count, can differ by an ulp).
"""
from __future__ import annotations

import contextlib

import torch


class LayoutRotaryEmbedding(torch.nn.Module):
    def __init__(self, base: torch.nn.Module, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.base, self.dtype = base, dtype
        self.positions = None  # set by `at` (BlockDiffusionModel.logits) around each forward

    @contextlib.contextmanager
    def at(self, positions: torch.Tensor):
        """Angles at `positions` [rows] (physical row order) for the forwards run inside the block."""
        previous, self.positions = self.positions, positions
        try:
            yield
        finally:
            self.positions = previous

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.base.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len=None, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if self.positions is None:
            raise RuntimeError("LayoutRotaryEmbedding used without positions: run through BlockDiffusionModel.logits "
                               "or inside `at(positions)`")
        pos = self.positions
        if self.base.inv_freq.device != pos.device:  # e.g. built on CPU, run on GPU
            self.base.inv_freq = self.base.inv_freq.to(pos.device)
        # Megatron's own frequency table (same arange, same outer product) indexed by position.
        freqs = self.base.get_freqs_non_repeated(int(pos.max()) + 1 + offset, 0)[pos + offset]
        if not getattr(self.base, "rotary_interleaved", False):
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :].to(self.dtype)
