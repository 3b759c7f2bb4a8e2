"""Per-rank attention work and exchange of a layout, counted exactly from the layout's metadata.

Uses the project's own `SequenceLayout` (the rows each rank holds) and the mask's clean-key
intervals, so the counts are those of the real block-diffusion mask, not an approximation:

- `sparse_pairs`: allowed (query, key) pairs of the rank's queries (what a block-sparse GPU kernel
  computes): a noisy query sees its B in-block noisy keys plus its clean interval, a clean query its
  clean interval;
- `dense_pairs`: query x key rectangles of the partials the rank runs, as
  `attention/block_attention.py` issues them (whole noisy blocks as a batch of B x B problems, keys
  that no local query sees dropped): what the CPU math kernel computes, masking afterwards;
- `exchange_rows`: clean rows this rank must receive from its ring in one sliding-window layer
  (the static window plan), vs all other shards of the ring for a full layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class RankWork:
    rows: int  # local rows (noisy + clean) through every layer
    noisy_rows: int  # rows that get logits
    clean_rows: int
    sparse_pairs: int
    dense_pairs: int
    exchange_rows: int  # clean rows received from the ring (sliding layers: window plan only)
    kv_rows_gathered: int  # rows of K/V this rank holds from others after the exchange


def _intervals(position: np.ndarray, is_clean: np.ndarray, B: int, clean_attention: str,
               window: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    block_start = (position // B) * B
    clean_hi = block_start + B if clean_attention == "block_causal" else position + 1
    hi = np.where(is_clean, clean_hi, block_start)
    if window is None:
        lo = np.zeros_like(hi)
    else:
        lo = np.maximum(np.where(is_clean, position - window + 1, block_start - (window - 1)), 0)
    return lo, np.maximum(hi, lo)


@lru_cache(maxsize=256)
def rank_work(seq_length: int, block_size: int, cp: int, bp: int, schedule: str, clean_attention: str,
              window: Optional[int]) -> Tuple[RankWork, ...]:
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry

    L, B = seq_length, block_size
    layout = SequenceLayout(BlockGeometry(L, B, clean_attention), cp, bp, schedule)
    kind = layout.kind
    out = []
    for r in range(layout.shard_group_size):
        rows = layout.rows(r)
        pos = rows.position.numpy()
        clean = rows.is_clean.numpy()
        n_noisy = int((~clean).sum())
        n_clean = len(pos) - n_noisy
        lo, hi = _intervals(pos, clean, B, clean_attention, window)
        sparse = int((hi - lo).sum()) + B * n_noisy
        # clean positions any local query may see (their union): the keys a partial keeps
        diff = np.zeros(L + 1, dtype=np.int64)
        np.add.at(diff, lo, 1)
        np.add.at(diff, hi, -1)
        need = np.cumsum(diff[:-1]) > 0
        used_clean = int(need.sum())
        # rectangles of the partials block_attention.py runs (keys no query sees are dropped;
        # whole noisy blocks run as a batch of B x B attentions)
        if kind == "cp":
            noisy_blocks = np.unique(pos[~clean] // B)
            dense = len(pos) * (used_clean + B * len(noisy_blocks))
            gathered = 2 * L - len(pos)
            exchange = gathered
        else:
            dense = n_noisy * B + len(pos) * used_clean
            if kind == "csbp":
                gathered = L - n_clean
                if window is None:
                    exchange = gathered
                else:
                    need[pos[clean]] = False
                    exchange = int(need.sum())
            else:  # single, bp: every clean key the rank needs is local
                gathered = exchange = 0
        out.append(RankWork(len(pos), n_noisy, n_clean, sparse, dense, exchange, gathered))
    return tuple(out)


def mask_pairs(seq_length: int, block_size: int, clean_attention: str = "block_causal",
               window: Optional[int] = None) -> int:
    """Allowed pairs of the whole [noisy ; clean] mask (L*(L+B) for full block-causal attention)."""
    return sum(w.sparse_pairs for w in rank_work(seq_length, block_size, 1, 1, "mirrored", clean_attention, window))


@dataclass(frozen=True)
class DrafterRankWork:
    """One rank's share of a DFlash drafter step (see `megatron_csbp.layout.dflash`)."""

    draft_rows: int  # rows through every drafter layer (blocks x block size, CP padding included)
    context_rows: int  # projected context rows held (K/V computed here)
    sparse_pairs: int  # allowed (draft query, key) pairs
    exchange_rows: int  # context (CSBP) or all (CP) rows received per full-attention layer


def drafter_rank_work(seq_length: int, block_size: int, anchors: int, cp: int, bp: int,
                      doc_length: Optional[int] = None) -> Tuple[DrafterRankWork, ...]:
    """Per-rank rows and pairs of a DFlash drafter under single / CP / BP / CSBP, counted from the
    real `DFlashLayout` with `anchors` anchors spread evenly over documents of `doc_length` tokens
    (default: one document). Metadata cost O(L + anchors x block_size) per rank."""
    import torch

    from megatron_csbp.layout.dflash import DFlashLayout

    L, B = seq_length, block_size
    D = doc_length or L
    if anchors < 1 or anchors > L - 1:
        raise ValueError(f"--dflash-max-anchors {anchors} must be in [1, {L - 1}]")
    a = torch.linspace(1, L - 2, anchors).round().long().unique()
    starts = (a // D) * D
    pos_starts = (torch.arange(L) // D) * D
    layout = DFlashLayout(L, B, cp, bp)
    owned = layout.owned(a, starts)
    out = []
    for r in range(layout.shard_group_size):
        rows = layout.rows(r, a, starts, pos_starts, owned)
        draft = int((~rows.is_clean).sum())
        ctx = len(rows) - draft
        mine = owned[r]
        pairs = int(((a[mine] - starts[mine]) * B).sum() + len(mine) * B * B)
        if layout.kind == "cp":
            exchange = (len(rows)) * (layout.shard_group_size - 1)
        elif layout.kind == "csbp":
            exchange = ctx * (cp - 1)
        else:
            exchange = 0
        out.append(DrafterRankWork(draft, ctx, pairs, exchange))
    return tuple(out)
