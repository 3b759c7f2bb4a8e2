"""A partial attention's mask as row vectors: what kernels read instead of a dense matrix.

`QueryRows` (block id, clean-key interval [lo, hi), is_clean) and `KeyRows` (position, block id,
is_clean); `pair_allowed` decides a pair element by element; `TileTable` classifies tiles exactly
as empty / full / partial. Sizes, linear in the rows: docs/attention-kernels.md.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import List, Tuple

import torch

from megatron_csbp.layout.masks import AnchoredGeometry, BlockGeometry, RowMeta, clean_key_interval, noisy_block_id

_I32 = torch.int32


def index_runs(index: torch.Tensor) -> List[slice]:
    """`index` as ranges of consecutive values, in order."""
    if not index.numel():
        return []
    cut = ((index[1:] != index[:-1] + 1).nonzero().flatten() + 1).tolist()
    bounds = [0] + cut + [index.numel()]
    return [slice(int(index[a]), int(index[a]) + (b - a)) for a, b in zip(bounds[:-1], bounds[1:])]


class _RowVectors:
    """Row vectors of one length (every field a tensor [rows]): selected, moved and sized alike."""

    @property
    def _vectors(self) -> Tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def __len__(self) -> int:
        return self._vectors[0].numel()

    def select(self, index):
        return type(self)(*(t[index] for t in self._vectors))

    def to(self, device):
        return type(self)(*(t.to(device) for t in self._vectors))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._vectors)


@dataclass(frozen=True)
class QueryRows(_RowVectors):
    """Per query row: noisy block id, is_clean, clean-key interval [lo, hi). All shape [rows]."""

    block: torch.Tensor
    is_clean: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor

    @staticmethod
    def of(meta: RowMeta, geometry: BlockGeometry) -> "QueryRows":
        if isinstance(geometry, AnchoredGeometry):
            # DFlash (`masks.anchored_allowed`): a draft row's block is its anchor, its context
            # interval [doc start, anchor), cut to positions > p - W on sliding layers. Context
            # rows are keys only: an empty interval, and clean, so they see no draft row either.
            lo = meta.doc_start
            if geometry.window is not None:
                lo = torch.maximum(lo, meta.position - geometry.window + 1)
            block, lo, hi = meta.anchor, lo.masked_fill(meta.is_clean, 0), meta.anchor.masked_fill(meta.is_clean, 0)
        else:
            block, (lo, hi) = noisy_block_id(meta.position, geometry), clean_key_interval(meta, geometry)
        return QueryRows(block.to(_I32), meta.is_clean.clone(), lo.to(_I32), hi.to(_I32))


@dataclass(frozen=True)
class KeyRows(_RowVectors):
    """Per key row: position, block id, is_clean. All shape [rows]."""

    position: torch.Tensor
    block: torch.Tensor
    is_clean: torch.Tensor

    @staticmethod
    def of(meta: RowMeta, geometry: BlockGeometry) -> "KeyRows":
        # a draft key's block is its anchor
        block = meta.anchor if isinstance(geometry, AnchoredGeometry) else noisy_block_id(meta.position, geometry)
        return KeyRows(meta.position.to(_I32), block.to(_I32), meta.is_clean.clone())


def pair_allowed(q_block, q_clean, q_lo, q_hi, k_pos, k_block, k_clean):
    """The predicate of `layout.masks.allowed`, element by element on broadcastable tensors."""
    same_noisy_block = ~q_clean & ~k_clean & (q_block == k_block)
    clean_in_interval = k_clean & (q_lo <= k_pos) & (k_pos < q_hi)
    return same_noisy_block | clean_in_interval


def _seen(clean_sorted, noisy_sorted, lo, hi, block, is_clean) -> torch.Tensor:
    """Per query (broadcast over leading dims): the keys it sees among sorted clean key positions
    (those in [lo, hi)) and sorted noisy key blocks (those of its block, noisy queries only)."""
    clean = (torch.searchsorted(clean_sorted, hi) - torch.searchsorted(clean_sorted, lo)).clamp_min(0)
    same_block = torch.searchsorted(noisy_sorted, block, right=True) - torch.searchsorted(noisy_sorted, block)
    return clean + torch.where(is_clean, 0, same_block)


def _pad(x: torch.Tensor, multiple: int, value) -> torch.Tensor:
    """`x` with rows of `value` appended along dim 0 up to a multiple of `multiple` rows."""
    extra = (-x.shape[0]) % multiple
    return torch.cat([x, x.new_full((extra,) + tuple(x.shape[1:]), value)]) if extra else x


@dataclass(frozen=True)
class TileTable:
    """Exact classification of (q tile, k tile) pairs: `occupied` (some pair allowed) and `full`
    (every real pair allowed; padding rows of a last, short tile count as allowed), bool
    [q_tiles, k_tiles]. Partial tiles are `occupied & ~full`."""

    q_tile: int
    k_tile: int
    occupied: torch.Tensor
    full: torch.Tensor

    @property
    def partial(self) -> torch.Tensor:
        return self.occupied & ~self.full

    @property
    def nbytes(self) -> int:
        return self.occupied.numel() + self.full.numel()


def _tile_table(q: QueryRows, k: KeyRows, q_tile: int, k_tile: int, chunk_rows: int) -> TileTable:
    """Per query row and key tile: count the allowed keys from sorted per-tile key vectors
    (searchsorted on clean positions and on noisy block ids), then reduce rows to q tiles."""
    device = q.block.device
    big = torch.iinfo(torch.int64).max // 4
    nk = len(k)
    kt = max(1, -(-nk // k_tile))
    # Per k tile: sorted clean positions (non-clean slots pushed to +big), sorted noisy blocks.
    def sorted_per_tile(keep, values):  # `values` where `keep` (+big elsewhere), sorted within each k tile
        return _pad(torch.where(keep, values.long(), big), k_tile, big).view(kt, k_tile).sort(dim=1).values.contiguous()

    clean_sorted, noisy_sorted = sorted_per_tile(k.is_clean, k.position), sorted_per_tile(~k.is_clean, k.block)
    real = _pad(torch.ones(nk, dtype=torch.long, device=device), k_tile, 0).view(kt, k_tile).sum(1)  # [kt]
    # A query row sees `seen` keys of a tile: clean ones inside [lo, hi), noisy ones of its own
    # block (noisy queries only). Occupied: seen > 0; full: seen == the tile's real keys. Rows go
    # in chunks of whole q tiles, reduced to tiles at once: the largest live tensor is
    # [k tiles x chunk rows], never [rows x k tiles].
    nq = len(q)
    qt = max(1, -(-nq // q_tile))
    chunk_rows = max(q_tile, chunk_rows - chunk_rows % q_tile)
    occ_tiles, full_tiles = [], []
    for start in range(0, nq, chunk_rows):
        sl = slice(start, min(nq, start + chunk_rows))
        lo, hi, qb = (x[sl].long()[None, :].expand(kt, -1).contiguous() for x in (q.lo, q.hi, q.block))
        seen = _seen(clean_sorted, noisy_sorted, lo, hi, qb, q.is_clean[sl][None, :])  # [kt, rows]
        occ = _pad((seen > 0).T, q_tile, False)  # [rows, kt]
        full = _pad((seen == real[:, None]).T, q_tile, True)
        occ_tiles.append(occ.view(-1, q_tile, kt).any(1))
        full_tiles.append(full.view(-1, q_tile, kt).all(1))
    if not occ_tiles:
        occ = torch.zeros(qt, kt, dtype=torch.bool, device=device)
        return TileTable(q_tile, k_tile, occ, occ.clone())
    occ, full = torch.cat(occ_tiles), torch.cat(full_tiles)
    return TileTable(q_tile, k_tile, occ, full & occ)


@dataclass(frozen=True, eq=False)
class PartialMask:
    """The mask of one partial attention: queries x keys, as row vectors. Owned by the plan that
    built it; whatever a kernel derives from it (tile tables, block masks) is cached on it and
    freed with it."""

    q: QueryRows
    k: KeyRows

    @staticmethod
    def of(q: RowMeta, k: RowMeta, geometry: BlockGeometry) -> "PartialMask":
        return PartialMask(QueryRows.of(q, geometry), KeyRows.of(k, geometry))

    @property
    def shape(self) -> Tuple[int, int]:
        return (len(self.q), len(self.k))

    def to(self, device) -> "PartialMask":
        return PartialMask(self.q.to(device), self.k.to(device))

    def block(self, q_index, k_index) -> torch.Tensor:
        """Bool [len(q_index), len(k_index)] for a sub-rectangle (a tile): row vectors gathered
        and compared, O(tile)."""
        q, k = self.q, self.k
        return pair_allowed(q.block[q_index, None], q.is_clean[q_index, None], q.lo[q_index, None], q.hi[q_index, None],
                            k.position[None, k_index], k.block[None, k_index], k.is_clean[None, k_index])

    def dense(self) -> torch.Tensor:
        """The whole [queries x keys] bool mask: for the math reference kernel and tests only."""
        return self.block(slice(None), slice(None))

    @staticmethod
    def block_diagonal(block_size: int, device=None) -> "PartialMask":
        """B noisy queries and B noisy keys of one block: every pair allowed (the folded
        block-diagonal attention's mask), 2 x B rows instead of a B x B matrix."""
        zeros = torch.zeros(block_size, dtype=_I32, device=device)
        noisy = torch.zeros(block_size, dtype=torch.bool, device=device)
        return PartialMask(QueryRows(zeros, noisy, zeros, zeros),
                           KeyRows(torch.arange(block_size, dtype=_I32, device=device), zeros, noisy.clone()))

    @property
    def nbytes(self) -> int:
        """Bytes of the row vectors (what the mask itself keeps; derived tables come on top)."""
        return self.q.nbytes + self.k.nbytes

    @cached_property
    def _derived(self) -> dict:
        return {}

    def derived(self, key, build):
        """What a kernel derives from this mask (tile tables, schedules, block masks), built once
        by `build()` and kept on the mask: owned by the plan that owns the mask, freed with it."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def derived_nbytes(self) -> int:
        """Bytes of the tensors cached by `derived` (tile tables and the like)."""
        return sum(int(getattr(value, "nbytes", 0)) for value in self._derived.values())

    def tiles(self, q_tile: int = 128, k_tile: int = 128, chunk_rows: int = 4096) -> TileTable:
        """Tile classification, cached per tile shape on this mask."""
        return self.derived(("tiles", q_tile, k_tile), lambda: _tile_table(self.q, self.k, q_tile, k_tile, chunk_rows))

    def keys_seen(self) -> torch.Tensor:
        """Bool [keys]: keys some query may attend, from an interval union (difference array
        over positions) and the set of noisy query blocks, never a dense mask."""
        q, k = self.q, self.k
        seen = torch.zeros(len(k), dtype=torch.bool, device=k.position.device)
        if len(q) == 0 or len(k) == 0:
            return seen
        # Clean keys: covered by the union of [lo, hi) intervals.
        span = int(max(int(q.hi.max()), int(k.position.max()) + 1))
        valid = q.lo < q.hi
        diff = torch.bincount(q.lo[valid], minlength=span + 1) - torch.bincount(q.hi[valid], minlength=span + 1)
        covered = diff.cumsum(0)[:-1] > 0
        seen |= k.is_clean & covered[k.position.long()]
        # Noisy keys: their block has a noisy query.
        noisy_q_blocks = torch.unique(q.block[~q.is_clean])
        seen |= ~k.is_clean & torch.isin(k.block, noisy_q_blocks)
        return seen

    def allowed_pairs(self) -> int:
        """Number of allowed pairs, without a dense mask: per query, clean keys in [lo, hi) by
        searchsorted over sorted clean key positions, plus noisy keys of its block."""
        q, k = self.q, self.k
        if len(q) == 0 or len(k) == 0:
            return 0
        clean_pos, noisy_blocks = k.position[k.is_clean].long().sort().values, k.block[~k.is_clean].long().sort().values
        return int(_seen(clean_pos, noisy_blocks, q.lo.long(), q.hi.long(), q.block.long(), q.is_clean).sum())
