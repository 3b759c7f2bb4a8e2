"""Block-diffusion attention semantics as per-row metadata (design brief section 1).

Every row of the logical [noisy ; clean] input is described by two numbers: whether it is a clean
row and its token position. The mask between any query rows and any key rows follows from those,
so the same predicate serves every layout and every physical key order (local, gathered, ring
chunk). A dense 2L x 2L matrix is only ever built by `dense_reference_mask`, the test oracle.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Optional, Sequence, Tuple

import torch

CLEAN_ATTENTION_VARIANTS = ("block_causal", "token_causal")


@dataclass(frozen=True)
class Documents:
    """Document boundaries of a packed sequence of `seq_length` positions: `starts`, the first
    position of every document, ascending, starting with 0 (Megatron's `--reset-attention-mask`
    documents: an EOD token belongs to the document it ends, the next position starts a new one).

    O(documents) integers, at most one per position: at 256K tokens the worst case (one-token
    documents) is 256K ints (2 MiB as int64), the same on every rank of a 16-rank shard group;
    per-row lookups (`start_of`, `end_of`, `index_of`) are searchsorted over them, nothing
    quadratic. Hashable (a tuple), so a geometry carrying documents stays a value."""

    starts: Tuple[int, ...]
    seq_length: int

    def __post_init__(self):
        starts = tuple(int(s) for s in self.starts)
        object.__setattr__(self, "starts", starts)
        if not starts or starts[0] != 0:
            raise ValueError(f"document starts must begin with 0, got {starts[:4]}")
        if any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= self.seq_length:
            raise ValueError(f"document starts must increase strictly inside [0, {self.seq_length})")

    @staticmethod
    def of_ids(ids: Sequence[int]) -> "Documents":
        """From one document id per position: a document is a run of equal ids; an id that comes
        back after another one is refused (it would join two stretches into one document)."""
        ids = torch.as_tensor(ids).flatten().long()
        if ids.numel() == 0:
            raise ValueError("document ids of an empty sequence")
        change = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
        starts = [0] + change.tolist()
        if len(torch.unique(ids)) != len(starts):
            raise ValueError("document ids must be contiguous runs (an id reappears after another document)")
        return Documents(tuple(starts), ids.numel())

    @staticmethod
    def of_eod(tokens: torch.Tensor, eod_token_id: int) -> "Documents":
        """From the clean tokens [L] of one sample: a document ends with (and includes) each EOD
        token, as Megatron's `get_ltor_masks_and_position_ids(reset_attention_mask=True)`."""
        tokens = tokens.flatten()
        ends = torch.nonzero(tokens[:-1] == eod_token_id).flatten() + 1
        return Documents(tuple([0] + ends.tolist()), tokens.numel())

    @cached_property
    def _starts(self) -> torch.Tensor:
        return torch.tensor(self.starts, dtype=torch.long)

    @cached_property
    def _ends(self) -> torch.Tensor:
        return torch.tensor(self.starts[1:] + (self.seq_length,), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.starts)

    def index_of(self, position: torch.Tensor) -> torch.Tensor:
        """The document index (0, 1, ...) of each position."""
        starts = self._starts.to(position.device)
        return torch.searchsorted(starts, position.long(), right=True) - 1

    def start_of(self, position: torch.Tensor) -> torch.Tensor:
        return self._starts.to(position.device)[self.index_of(position)]

    def end_of(self, position: torch.Tensor) -> torch.Tensor:
        """One past the last position of each position's document."""
        return self._ends.to(position.device)[self.index_of(position)]

    @property
    def lengths(self) -> Tuple[int, ...]:
        return tuple((self._ends - self._starts).tolist())

    def ids(self) -> torch.Tensor:
        """Document index per position [L] (for oracles and tests)."""
        return self.index_of(torch.arange(self.seq_length))


@dataclass(frozen=True)
class BlockGeometry:
    """What the mask depends on: sequence length, block size, clean variant, sliding window and,
    for packed sequences, the document boundaries (`Documents`; None: one document)."""

    seq_length: int
    block_size: int
    clean_attention: str = "block_causal"
    window: Optional[int] = None
    documents: Optional[Documents] = None

    def __post_init__(self):
        if self.block_size <= 0 or self.seq_length <= 0:
            raise ValueError(f"--seq-length ({self.seq_length}) and --block-size ({self.block_size}) must be positive")
        if self.seq_length % self.block_size != 0:
            raise ValueError(f"--block-size {self.block_size} does not divide --seq-length {self.seq_length} "
                             f"(--seq-length {self.seq_length} is not a multiple of --block-size {self.block_size}): "
                             "block diffusion needs whole blocks (no silent round-down)")
        if self.clean_attention not in CLEAN_ATTENTION_VARIANTS:
            raise ValueError(f"--clean-attention must be one of {CLEAN_ATTENTION_VARIANTS}, "
                             f"got {self.clean_attention!r}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"sliding window must be positive, got {self.window}")
        if self.documents is not None and self.documents.seq_length != self.seq_length:
            raise ValueError(f"documents cover {self.documents.seq_length} positions, --seq-length is {self.seq_length}")

    @property
    def num_blocks(self) -> int:
        return self.seq_length // self.block_size

    def with_window(self, window: Optional[int]) -> "BlockGeometry":
        return replace(self, window=window)

    def with_documents(self, documents: Optional[Documents]) -> "BlockGeometry":
        # one document: the unpacked geometry, same masks and fast paths
        return replace(self, documents=None if documents is not None and len(documents) == 1 else documents)


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

    #: no geometry-level documents: an anchored row carries its own (`RowMeta.doc_start`); kept so
    #: code reading `geometry.documents` treats both geometries alike
    documents = None

    def with_window(self, window: Optional[int]) -> "AnchoredGeometry":
        return replace(self, window=window)


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
        is_clean = torch.cat([torch.zeros(len(noisy_positions), dtype=torch.bool),
                              torch.ones(len(clean_positions), dtype=torch.bool)])
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

    def _map(self, fn) -> "RowMeta":
        vectors = (self.is_clean, self.position, self.anchor, self.doc_start)
        return RowMeta(*(None if t is None else fn(t) for t in vectors))

    def select(self, index) -> "RowMeta":
        return self._map(lambda t: t[index])

    def to(self, device) -> "RowMeta":
        return self._map(lambda t: t.to(device))

    @staticmethod
    def anchored(anchors: torch.Tensor, doc_starts: torch.Tensor, block_size: int,
                 context_positions: torch.Tensor, context_doc_starts: torch.Tensor) -> "RowMeta":
        """DFlash rows [draft blocks ; context]: block i holds positions anchors[i] + 0..B-1 (anchor
        anchors[i], document start doc_starts[i]); context rows are clean, key-only."""
        anchors, doc_starts = anchors.long(), doc_starts.long()
        rows = RowMeta.of((anchors[:, None] + torch.arange(block_size)).flatten(), context_positions)
        return replace(rows, anchor=torch.cat([anchors.repeat_interleave(block_size),
                                               torch.full((context_positions.numel(),), -1, dtype=torch.long)]),
                       doc_start=torch.cat([doc_starts.repeat_interleave(block_size), context_doc_starts.long()]))


def noisy_block_id(position: torch.Tensor, geometry: BlockGeometry) -> torch.Tensor:
    """The id of a noisy row's block: noisy rows attend each other iff their ids are equal. The
    block index `p // B`; with documents the piece of the block inside the row's document, named
    by its first position `max(block start, document start)` (the global block grid split at
    document boundaries)."""
    block = position // geometry.block_size
    if geometry.documents is None:
        return block
    return torch.maximum(block * geometry.block_size, geometry.documents.start_of(position))


def clean_key_interval(q: RowMeta, geometry: BlockGeometry):
    """Per query, the half-open interval [lo, hi) of clean key positions it may attend to; with
    documents cut to the query's document [start, end) (then possibly empty, lo == hi)."""
    B, W = geometry.block_size, geometry.window
    block_start = (q.position // B) * B
    clean_hi = block_start + B if geometry.clean_attention == "block_causal" else q.position + 1
    # Noisy queries see the strict clean prefix before their block.
    hi = torch.where(q.is_clean, clean_hi, block_start)
    if W is None:
        lo = torch.zeros_like(hi)
    else:
        # Clean query: the last W positions including itself; noisy: the W-1 before its block.
        lo = torch.where(q.is_clean, q.position - W + 1, block_start - (W - 1)).clamp_min(0)
    if geometry.documents is not None:
        docs = geometry.documents
        hi = torch.minimum(hi, docs.end_of(q.position))
        lo = torch.minimum(torch.maximum(lo, docs.start_of(q.position)), hi)
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
    lo, hi = clean_key_interval(q, geometry)
    same_block = noisy_block_id(q.position, geometry)[:, None] == noisy_block_id(k.position, geometry)[None, :]
    same_noisy_block = (~q.is_clean[:, None]) & (~k.is_clean[None, :]) & same_block
    kp = k.position[None, :]
    clean_in_interval = k.is_clean[None, :] & (lo[:, None] <= kp) & (kp < hi[:, None])
    return same_noisy_block | clean_in_interval


def dense_reference_mask(seq_len: int, block_size: int, clean_attention: str = "block_causal",
                         window: Optional[int] = None,
                         document_ids: Optional[Sequence[int]] = None) -> torch.BoolTensor:
    """The [2L, 2L] mask in logical order [noisy ; clean], True = may attend. Test oracle only.

    Written straight from the rule table of the design brief, independently of `allowed`.
    `document_ids` (one per position): a pair is allowed only inside one document, on top of
    the table (packed sequences, docs/semantics.md "Packed documents").
    """
    geometry = BlockGeometry(seq_len, block_size, clean_attention, window)
    doc = [0] * seq_len if document_ids is None else [int(d) for d in document_ids]
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
            mask[i, j] = ok and doc[qp] == doc[kp]
    return mask


def logical_rows(seq_len: int) -> RowMeta:
    """Metadata of the 2L logical rows [noisy ; clean] in order."""
    pos = torch.arange(seq_len)
    return RowMeta.of(pos, pos)
