"""Block-diffusion attention semantics as per-row metadata (design brief section 1).

Every row of the logical [noisy ; clean] input is described by two numbers: whether it is a clean
row and its token position. The mask between any query rows and any key rows follows from those,
so the same predicate serves every layout and every physical key order (local, gathered, ring
chunk). A dense 2L x 2L matrix is only ever built by `dense_reference_mask`, the test oracle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

CLEAN_ATTENTION_VARIANTS = ("block_causal", "token_causal")


@dataclass(frozen=True)
class BlockGeometry:
    """What the mask depends on: sequence length, block size, clean variant, sliding window."""

    seq_length: int
    block_size: int
    clean_attention: str = "block_causal"
    window: Optional[int] = None

    def __post_init__(self):
        if self.block_size <= 0 or self.seq_length <= 0:
            raise ValueError(
                f"--seq-length ({self.seq_length}) and --block-size ({self.block_size}) must be positive"
            )
        if self.seq_length % self.block_size != 0:
            raise ValueError(
                f"--seq-length {self.seq_length} is not a multiple of --block-size {self.block_size}: "
                "block diffusion needs whole blocks (no silent round-down)"
            )
        if self.clean_attention not in CLEAN_ATTENTION_VARIANTS:
            raise ValueError(
                f"--clean-attention must be one of {CLEAN_ATTENTION_VARIANTS}, got {self.clean_attention!r}"
            )
        if self.window is not None and self.window <= 0:
            raise ValueError(f"sliding window must be positive, got {self.window}")

    @property
    def num_blocks(self) -> int:
        return self.seq_length // self.block_size

    def with_window(self, window: Optional[int]) -> "BlockGeometry":
        return BlockGeometry(self.seq_length, self.block_size, self.clean_attention, window)


@dataclass(frozen=True)
class RowMeta:
    """Metadata of a set of rows: `is_clean` (bool) and `position` (int64), both of shape [rows]."""

    is_clean: torch.Tensor
    position: torch.Tensor

    def __post_init__(self):
        assert self.is_clean.shape == self.position.shape and self.is_clean.dim() == 1

    def __len__(self) -> int:
        return self.position.numel()

    @staticmethod
    def of(noisy_positions: torch.Tensor, clean_positions: torch.Tensor) -> "RowMeta":
        """Rows ordered [noisy rows ; clean rows]."""
        position = torch.cat([noisy_positions, clean_positions]).long()
        is_clean = torch.cat(
            [torch.zeros(len(noisy_positions), dtype=torch.bool), torch.ones(len(clean_positions), dtype=torch.bool)]
        )
        return RowMeta(is_clean, position)

    @staticmethod
    def cat(metas) -> "RowMeta":
        metas = list(metas)
        return RowMeta(torch.cat([m.is_clean for m in metas]), torch.cat([m.position for m in metas]))

    def select(self, index) -> "RowMeta":
        return RowMeta(self.is_clean[index], self.position[index])

    def to(self, device) -> "RowMeta":
        return RowMeta(self.is_clean.to(device), self.position.to(device))


def clean_key_interval(q: RowMeta, geometry: BlockGeometry):
    """Per query, the half-open interval [lo, hi) of clean key positions it may attend to."""
    B, W = geometry.block_size, geometry.window
    block_start = (q.position // B) * B
    if geometry.clean_attention == "block_causal":
        clean_hi = block_start + B
    else:
        clean_hi = q.position + 1
    # Noisy queries see the strict clean prefix before their block.
    hi = torch.where(q.is_clean, clean_hi, block_start)
    if W is None:
        lo = torch.zeros_like(hi)
    else:
        # Clean query: the last W positions including itself; noisy: the W-1 before its block.
        lo = torch.where(q.is_clean, q.position - W + 1, block_start - (W - 1)).clamp_min(0)
    return lo, hi


def allowed(q: RowMeta, k: RowMeta, geometry: BlockGeometry) -> torch.Tensor:
    """Bool [q_rows, k_rows]: may query i attend to key j. The single predicate of the project."""
    B = geometry.block_size
    lo, hi = clean_key_interval(q, geometry)
    same_noisy_block = (~q.is_clean[:, None]) & (~k.is_clean[None, :]) & (
        (q.position // B)[:, None] == (k.position // B)[None, :]
    )
    kp = k.position[None, :]
    clean_in_interval = k.is_clean[None, :] & (lo[:, None] <= kp) & (kp < hi[:, None])
    return same_noisy_block | clean_in_interval


def dense_reference_mask(
    seq_len: int, block_size: int, clean_attention: str = "block_causal", window: Optional[int] = None
) -> torch.BoolTensor:
    """The [2L, 2L] mask in logical order [noisy ; clean], True = may attend. Test oracle only.

    Written straight from the rule table of the design brief, independently of `allowed`.
    """
    geometry = BlockGeometry(seq_len, block_size, clean_attention, window)
    L, B = seq_len, block_size
    mask = torch.zeros(2 * L, 2 * L, dtype=torch.bool)
    for i in range(2 * L):
        q_clean, qp = i >= L, i % L
        qb = qp // B
        for j in range(2 * L):
            k_clean, kp = j >= L, j % L
            kb = kp // B
            if not q_clean and not k_clean:
                ok = kb == qb
            elif not q_clean and k_clean:
                ok = kb < qb and (window is None or kp >= qb * B - (window - 1))
            elif q_clean and k_clean:
                ok = kb <= qb if geometry.clean_attention == "block_causal" else kp <= qp
                ok = ok and (window is None or kp > qp - window)
            else:
                ok = False
            mask[i, j] = ok
    return mask


def logical_rows(seq_len: int) -> RowMeta:
    """Metadata of the 2L logical rows [noisy ; clean] in order."""
    pos = torch.arange(seq_len)
    return RowMeta.of(pos, pos)
