"""Per-rank attention work and exchange of a layout, counted exactly from the layout's metadata.

From the project's own `SequenceLayout` and the mask's clean-key intervals (the real mask, not an
approximation): `sparse_pairs` (what a block-sparse kernel computes), `dense_pairs` (the partials'
rectangles, as the math kernel computes them), `exchange_rows` (clean rows received in a
sliding-window layer); packed samples cut the mask to documents. docs/planner.md (the cost model's
"attention work" row; "Packed documents").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
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


def _intervals(position: np.ndarray, is_clean: np.ndarray, B: int, clean_attention: str, window: Optional[int],
               doc_start: np.ndarray, doc_end: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Each query's clean-key interval [lo, hi), cut to its document (masks.clean_key_interval)."""
    block_start = (position // B) * B
    clean_hi = block_start + B if clean_attention == "block_causal" else position + 1
    hi = np.minimum(np.where(is_clean, clean_hi, block_start), doc_end)
    lo = 0 if window is None else np.where(is_clean, position - window + 1, block_start - (window - 1))
    lo = np.minimum(np.maximum(lo, doc_start), hi)
    return lo, np.maximum(hi, lo)


def _sequence_layout(L: int, B: int, cp: int, bp: int, schedule: str, clean_attention: str):
    """The trainer's `SequenceLayout` of the sizes (imported here: the planner imports without torch)."""
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry

    return SequenceLayout(BlockGeometry(L, B, clean_attention), cp, bp, schedule)


@lru_cache(maxsize=256)
def rank_work(seq_length: int, block_size: int, cp: int, bp: int, schedule: str, clean_attention: str,
              window: Optional[int], documents: Optional[Tuple[int, ...]] = None) -> Tuple[RankWork, ...]:
    """Per rank of the shard group. `documents`: a packed sample's document starts (None or one
    document: unpacked). Transient: the rank's row metadata and a length-L difference array
    (at 256K tokens on 16 CSBP ranks 32K rows and 2 MiB of int64 per rank); with documents also
    the per-block costs (1K ints at B = 256) and the document starts."""
    L, B = seq_length, block_size
    layout = _sequence_layout(L, B, cp, bp, schedule, clean_attention)
    kind = layout.kind
    packed = documents is not None and len(documents) > 1
    if packed:
        from megatron_csbp.layout.masks import Documents
        from megatron_csbp.layout.packing import block_costs

        docs = Documents(documents, L)  # validates the starts
        if kind == "bp":  # the trainer's per-sample cost-balanced ownership (not under CSBP:
            # moving blocks off their documents' clean shard multiplies the exchange)
            layout = replace(layout, block_costs=block_costs(docs, B, L))
    starts = np.asarray(documents if packed else (0,), dtype=np.int64)  # unpacked: one document
    ends = np.append(starts[1:], L)
    out = []
    for r in range(layout.shard_group_size):
        rows = layout.rows(r)
        pos, clean = rows.position.numpy(), rows.is_clean.numpy()
        n_noisy = int((~clean).sum())
        n_clean = len(pos) - n_noisy
        doc = np.searchsorted(starts, pos, side="right") - 1  # each position's document [start, end)
        doc_start, doc_end = starts[doc], ends[doc]
        lo, hi = _intervals(pos, clean, B, clean_attention, window, doc_start, doc_end)
        # a noisy query sees the piece of its block inside its document
        bs = (pos[~clean] // B) * B
        piece = np.minimum(bs + B, doc_end[~clean]) - np.maximum(bs, doc_start[~clean])
        sparse = int((hi - lo).sum()) + int(piece.sum())
        # clean positions any local query may see (their union): the keys a partial keeps
        need = np.cumsum(np.bincount(lo, minlength=L + 1) - np.bincount(hi, minlength=L + 1))[:-1] > 0
        used_clean = int(need.sum())
        # rectangles of the partials block_attention.py runs (keys no query sees are dropped;
        # whole noisy blocks run as a batch of B x B attentions)
        if kind == "cp":
            dense = len(pos) * (used_clean + B * len(np.unique(pos[~clean] // B)))
            gathered = exchange = 2 * L - len(pos)
        else:
            dense = n_noisy * B + len(pos) * used_clean
            if kind == "csbp":
                gathered = L - n_clean
                if window is None and not packed:
                    exchange = gathered
                else:
                    need[pos[clean]] = False
                    exchange = int(need.sum())
                    if packed:
                        gathered = exchange  # the packed plan's rows are all a rank holds
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
    """One rank's share of a DFlash drafter step (see `megatron_csbp.attention.dflash`)."""

    draft_rows: int  # rows through every drafter layer (blocks x block size, CP padding included)
    context_rows: int  # projected context rows held (K/V computed here)
    sparse_pairs: int  # allowed (draft query, key) pairs
    exchange_rows: int  # context (CSBP) or all (CP) rows received per full-attention layer


@lru_cache(maxsize=64)
def drafter_rank_work(seq_length: int, block_size: int, anchors: int, cp: int, bp: int,
                      doc_length: Optional[int] = None, window: Optional[int] = None) -> Tuple[DrafterRankWork, ...]:
    """Per-rank rows and pairs of a DFlash drafter under single / CP / BP / CSBP, counted from the
    real `DFlashLayout` with `anchors` anchors spread evenly over documents of `doc_length` tokens
    (default: one document). `window`: the project's W of a sliding drafter layer (keys k > p - W;
    `DrafterShape.window`): pairs and, under CSBP, the rows the windowed clean exchange receives
    (the core's `WindowExchangePlan`) are those of that layer. Metadata cost O(L + anchors x
    block_size) per rank, all ranks' rows held while counting (at 512K tokens, 512 anchors of 16 on
    8 CSBP ranks: 64K context rows and 1K draft rows per rank; at 256K tokens on 16 ranks 16K + the
    draft rows; BP ranks hold the context their blocks need, up to L each)."""
    import torch

    L = seq_length
    D = doc_length or L
    if anchors < 1 or anchors > L - 1:
        raise ValueError(f"--dflash-max-anchors {anchors} must be in [1, {L - 1}]")
    a = torch.linspace(1, L - 2, anchors).round().long().unique()
    return drafter_work_for(L, block_size, a, (a // D) * D, (torch.arange(L) // D) * D, cp, bp, window)


def drafter_work_for(seq_length: int, block_size: int, a, starts, pos_starts, cp: int, bp: int,
                     window: Optional[int] = None) -> Tuple[DrafterRankWork, ...]:
    """`drafter_rank_work` for given anchors `a`, their document starts and every position's
    document start (tensors, as `DFlashLayout.rows` takes them)."""
    import torch

    from megatron_csbp.attention.dflash import DFlashLayout

    L, B = seq_length, block_size
    layout = DFlashLayout(L, B, cp, bp)
    owned = layout.owned(a, starts)
    all_rows = [layout.rows(r, a, starts, pos_starts, owned) for r in range(layout.shard_group_size)]
    out = []
    for r, rows in enumerate(all_rows):
        draft = int((~rows.is_clean).sum())
        ctx = len(rows) - draft
        mine = owned[r]
        # slot k at p = a + k sees context [max(s, p - W + 1), a) (no window: [s, a))
        lo = torch.maximum(starts[mine][:, None], a[mine][:, None] + torch.arange(B)[None, :] - (window or L + B) + 1)
        pairs = int((a[mine][:, None] - lo).clamp_min(0).sum()) + len(mine) * B * B
        if layout.kind == "cp":
            exchange = len(rows) * (layout.shard_group_size - 1)
        elif layout.kind == "csbp" and window is not None:
            from megatron_csbp.layout.exchange import WindowExchangePlan
            from megatron_csbp.layout.masks import AnchoredGeometry

            j, i = layout.ring_of(r)
            members = [all_rows[m] for m in range(j * cp, (j + 1) * cp)]
            peers = [m.select(slice(int((~m.is_clean).sum()), None)) for m in members]
            plan = WindowExchangePlan.build(members, peers, AnchoredGeometry(B, window), i)
            exchange = int(sum(plan.recv_counts))
        elif layout.kind == "csbp":
            exchange = ctx * (cp - 1)
        else:
            exchange = 0
        out.append(DrafterRankWork(draft, ctx, pairs, exchange))
    return tuple(out)


@dataclass(frozen=True)
class GDNRankWork:
    """One rank's share of a Gated DeltaNet layer under a layout, counted as
    `attention/gated_delta.py` places it (`build_routes`): the clean stream's runs, the ring that
    shares it, the boundary states sent to / received from block owners, and the chunk lengths of
    the chunked delta rule (chunks are cut at block starts and run ends)."""

    ring: int  # ranks sharing the clean stream (1: single / BP, nothing moves)
    max_runs: int  # most clean runs (segments) of any ring member: the all-gathers' padding
    boundary_sent: int  # blocks whose boundary state (S at bB and the K-1 pre-conv rows) this rank sends
    boundary_received: int
    clean_tokens: int  # rows through the clean recurrence
    clean_sq: int  # sum of squared chunk lengths of the clean recurrence (the T x T terms)
    noisy_tokens: int  # rows of the noisy blocks (each block one chunk of B)


@lru_cache(maxsize=64)
def gdn_rank_work(seq_length: int, block_size: int, cp: int, bp: int, schedule: str,
                  clean_attention: str) -> Tuple[GDNRankWork, ...]:
    """Per rank of the shard group. Kept: one `GDNRankWork` (7 integers) per rank. Transient while
    counting: every rank's row metadata (as `rank_work`: 2L positions over CP / CSBP ranks, 4 MiB of
    int64 at 256K tokens on 16 ranks; BP's replicated prefixes about 9 x that), the runs of each
    rank (at most 2 per ring member under CP / CSBP, one prefix under BP) and one holder lookup per
    noisy block (at 256K tokens, B = 256: 1K blocks)."""
    from megatron_csbp.layout.rows import index_runs

    L, B = seq_length, block_size
    layout = _sequence_layout(L, B, cp, bp, schedule, clean_attention)
    P = layout.shard_group_size
    rows = [layout.rows(r) for r in range(P)]
    clean = [r.position[r.is_clean].sort().values for r in rows]
    blocks = [np.unique(r.position[~r.is_clean].numpy() // B) for r in rows]
    runs = [index_runs(c) for c in clean]  # each rank's clean runs (slices of positions)
    kind = layout.kind
    out = []
    for r in range(P):
        # (the CP baseline's clean stream spans the whole shard group)
        ring = {"single": [r], "bp": [r], "cp": list(range(P))}.get(kind) or layout.ring_ranks(r)
        sent = received = 0
        if len(ring) > 1:  # each noisy block's boundary state comes from the holder of the row before it
            held = sorted((run.start, m) for m in ring for run in runs[m])
            starts, owner = np.array([x for x, _ in held]), np.array([m for _, m in held])
            for m in ring:
                b = blocks[m][blocks[m] > 0]
                src = owner[np.searchsorted(starts, b * B - 1, side="right") - 1]
                src = src[src != m]  # the boundaries that move
                sent += int((src == r).sum())
                received += len(src) if m == r else 0
        sq = 0
        for run in runs[r]:
            cuts = [run.start, *range((run.start // B + 1) * B, run.stop, B), run.stop]
            sq += sum((c1 - c0) ** 2 for c0, c1 in zip(cuts, cuts[1:]))
        out.append(GDNRankWork(len(ring), max(len(runs[m]) for m in ring), sent, received, len(clean[r]), sq,
                               len(blocks[r]) * B))
    return tuple(out)


def gdn_bytes_sent(w: GDNRankWork, heads: int, d_k: int, d_v: int, conv_dim: int, conv_kernel: int,
                   act_bytes: int, state_bytes: int, batch: int = 1) -> Tuple[int, int]:
    """(forward, backward) bytes one rank sends in one GDN layer, as the transports record them in
    `traffic_counter()` (`heads`, `conv_dim`: this TP rank's share): the ring all-gathers the
    K-1 pre-conv tail rows of every run (activation dtype) and the runs' transfer maps [M | N]
    (H x d_k x (d_k + d_v), state dtype: fp32, fp64 in fp64 runs), padded to the ring's most runs;
    then one all-to-all moves each boundary (H d_k d_v state + (K-1) conv rows, state dtype) to its
    block's owner. Backward: the gathers' gradients the same size, the all-to-all's gradients back
    the other way (a rank sends what it received)."""
    if w.ring == 1:
        return 0, 0
    gathers = (w.ring - 1) * w.max_runs * batch * ((conv_kernel - 1) * conv_dim * act_bytes
                                                   + heads * d_k * (d_k + d_v) * state_bytes)
    width = batch * (heads * d_k * d_v + (conv_kernel - 1) * conv_dim) * state_bytes
    return gathers + w.boundary_sent * width, gathers + w.boundary_received * width
