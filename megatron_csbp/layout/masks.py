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
                f"--block-size {self.block_size} does not divide --seq-length {self.seq_length} (--seq-length "
                f"{self.seq_length} is not a multiple of --block-size {self.block_size}): block diffusion needs "
                "whole blocks (no silent round-down)"
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
class AnchoredGeometry:
    """DFlash draft blocks (see `anchored_allowed`): blocks of `block_size` rows opened at arbitrary
    anchor positions, over a key-only clean context. `window` W (sliding layers): a draft query at
    position p sees context keys k > p - W (Hugging Face's bidirectional window of W - 1)."""

    block_size: int
    window: Optional[int] = None

    def __post_init__(self):
        if self.block_size <= 0:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        if self.window is not None and self.window < self.block_size:
            raise ValueError(f"sliding window {self.window} is smaller than --block-size {self.block_size}: "
                             "a draft block must see itself whole")

    def with_window(self, window: Optional[int]) -> "AnchoredGeometry":
        return AnchoredGeometry(self.block_size, window)


@dataclass(frozen=True)
class RowMeta:
    """Metadata of a set of rows: `is_clean` (bool) and `position` (int64), both of shape [rows].

    Anchored (DFlash) rows also carry `anchor` (int64: the anchor position of a draft row's block,
    -1 on context rows) and `doc_start` (int64: first position of the row's document)."""

    is_clean: torch.Tensor
    position: torch.Tensor
    anchor: Optional[torch.Tensor] = None
    doc_start: Optional[torch.Tensor] = None

    def __post_init__(self):
        assert self.is_clean.shape == self.position.shape and self.is_clean.dim() == 1
        assert (self.anchor is None) == (self.doc_start is None)
        if self.anchor is not None:
            assert self.anchor.shape == self.position.shape == self.doc_start.shape

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
        is_clean, position = torch.cat([m.is_clean for m in metas]), torch.cat([m.position for m in metas])
        if all(m.anchor is None for m in metas):
            return RowMeta(is_clean, position)
        if any(m.anchor is None and len(m) for m in metas):
            raise ValueError("cannot concatenate anchored and plain rows")
        live = [m for m in metas if m.anchor is not None]
        return RowMeta(is_clean, position, torch.cat([m.anchor for m in live]), torch.cat([m.doc_start for m in live]))

    def select(self, index) -> "RowMeta":
        if self.anchor is None:
            return RowMeta(self.is_clean[index], self.position[index])
        return RowMeta(self.is_clean[index], self.position[index], self.anchor[index], self.doc_start[index])

    def to(self, device) -> "RowMeta":
        if self.anchor is None:
            return RowMeta(self.is_clean.to(device), self.position.to(device))
        return RowMeta(self.is_clean.to(device), self.position.to(device), self.anchor.to(device),
                       self.doc_start.to(device))

    @staticmethod
    def anchored(anchors: torch.Tensor, doc_starts: torch.Tensor, block_size: int,
                 context_positions: torch.Tensor, context_doc_starts: torch.Tensor) -> "RowMeta":
        """DFlash rows [draft blocks ; context]: block i holds positions anchors[i] + 0..B-1 (anchor
        anchors[i], document start doc_starts[i]); context rows are clean, key-only."""
        anchors, doc_starts = anchors.long(), doc_starts.long()
        offsets = torch.arange(block_size)
        draft_pos = (anchors[:, None] + offsets).flatten()
        n, c = draft_pos.numel(), context_positions.numel()
        return RowMeta(
            torch.cat([torch.zeros(n, dtype=torch.bool), torch.ones(c, dtype=torch.bool)]),
            torch.cat([draft_pos, context_positions.long()]),
            torch.cat([anchors.repeat_interleave(block_size), torch.full((c,), -1, dtype=torch.long)]),
            torch.cat([doc_starts.repeat_interleave(block_size), context_doc_starts.long()]),
        )


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


def anchored_allowed(q: RowMeta, k: RowMeta, geometry: AnchoredGeometry) -> torch.Tensor:
    """The DFlash rule: a draft query (anchor a, document start s, position p) sees the draft rows
    of its own block (same anchor) and the context keys at positions in [s, a), and on a sliding
    layer only those with position > p - W. Context rows are keys only: they query nothing."""
    if q.anchor is None or k.anchor is None:
        raise ValueError("anchored geometry needs rows with anchors (RowMeta.anchored)")
    draft_q = ~q.is_clean[:, None]
    same_block = draft_q & (~k.is_clean[None, :]) & (q.anchor[:, None] == k.anchor[None, :])
    kp = k.position[None, :]
    context = draft_q & k.is_clean[None, :] & (kp >= q.doc_start[:, None]) & (kp < q.anchor[:, None])
    if geometry.window is not None:
        context = context & (kp > q.position[:, None] - geometry.window)
    return same_block | context


def allowed(q: RowMeta, k: RowMeta, geometry: BlockGeometry) -> torch.Tensor:
    """Bool [q_rows, k_rows]: may query i attend to key j. The single predicate of the project
    (with its anchored DFlash form, `anchored_allowed`, for an `AnchoredGeometry`)."""
    if isinstance(geometry, AnchoredGeometry):
        return anchored_allowed(q, k, geometry)
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
