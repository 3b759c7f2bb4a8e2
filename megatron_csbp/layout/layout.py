"""Which rows of the logical [noisy ; clean] input each rank of the shard group holds: the four
layouts `single`, `cp`, `bp`, `csbp` (docs/semantics.md#rows). Local rows are always
[owned noisy rows ; clean rows]; everything here is static metadata, the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import List, Optional, Tuple

import torch

from megatron_csbp.layout.masks import BlockGeometry, RowMeta
from megatron_csbp.layout.sizes import OWNERSHIP_SCHEDULES, ShardGroupSizes, check_parallel_sizes


def balanced_block_unit(bp: int, schedule: str) -> int:
    """Noisy-block counts that split equally over `bp` block-parallel ranks are multiples of this:
    mirrored ownership hands out pairs (i, n-1-i), contiguous ownership single blocks."""
    return 2 * bp if schedule == "mirrored" else bp


def split_evenly(items: List[int], parts: int) -> List[List[int]]:
    """Contiguous split into `parts` pieces whose sizes differ by at most one (larger first)."""
    q, r = divmod(len(items), parts)
    return [items[i * q + min(i, r) : (i + 1) * q + min(i + 1, r)] for i in range(parts)]


def mirrored_order(num_blocks: int) -> List[int]:
    """Blocks in mirrored-pair order 0, n-1, 1, n-2, ...: each pair (i, n-1-i) costs the same
    noisy-prefix work, so any contiguous split of this order into equal counts is balanced."""
    return [b for i in range((num_blocks + 1) // 2) for b in sorted({i, num_blocks - 1 - i})]


def balanced_owners(blocks: List[int], costs, counts: List[int]) -> List[List[int]]:
    """Blocks to ranks by cost, rank i getting exactly counts[i] blocks: blocks in decreasing cost
    each to the rank with the least cost so far among those with room (longest processing time
    first, capacity-bounded). Ties broken by block and rank index, so every rank computes the same.
    O(blocks x ranks)."""
    order = sorted(blocks, key=lambda b: (-int(costs[b]), b))
    load, parts = [0] * len(counts), [[] for _ in counts]
    for b in order:
        r = min((i for i in range(len(counts)) if len(parts[i]) < counts[i]), key=lambda i: (load[i], i))
        parts[r].append(b)
        load[r] += int(costs[b])
    return parts


def zigzag_rows(num_chunks_half: int, rank: int, chunk: int) -> torch.Tensor:
    """The rows held by `rank` when a stream is cut into 2P chunks of `chunk` rows: chunks r and 2P-1-r."""
    return torch.cat([torch.arange(a * chunk, (a + 1) * chunk) for a in (rank, 2 * num_chunks_half - 1 - rank)])


@dataclass(frozen=True)
class SequenceLayout(ShardGroupSizes):
    """The placement of rows over the `bp_size`-rank shard group (or `cp_size` for CP only)."""

    geometry: BlockGeometry
    cp_size: int = 1
    bp_size: int = 1
    schedule: str = "mirrored"
    #: first block with a noisy copy (0: every block)
    canvas_start: int = 0
    #: clean rows carry a loss term (each counted by one rank, see `clean_loss_positions`)
    clean_loss: bool = False
    #: packed samples (BP / CSBP): the attention cost of every block (`layout.packing.block_costs`);
    #: noisy blocks then go to ranks by cost (`balanced_owners`), each rank keeping its block count
    block_costs: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        cp, bp, g = self.cp_size, self.bp_size, self.geometry
        check_parallel_sizes(cp, bp)
        if self.schedule not in OWNERSHIP_SCHEDULES:
            raise ValueError(f"--block-ownership must be one of {OWNERSHIP_SCHEDULES}, got {self.schedule!r}")
        P = self.shard_group_size
        if P > 1 and g.seq_length % (2 * P) != 0:  # one rank cuts nothing: any length
            raise ValueError(f"--seq-length {g.seq_length} must be divisible by 2 x max(--context-parallel-size, "
                             f"--block-parallel-size) = {2 * P} (zigzag sharding cuts the stream into {2 * P} equal "
                             f"chunks: divisible by 2 x {P} shard-group ranks)")
        if self.kind in ("bp", "csbp") and g.num_blocks < bp:
            raise ValueError(f"{g.num_blocks} blocks (--seq-length {g.seq_length} / --block-size {g.block_size}) "
                             f"are fewer than --block-parallel-size {bp}: every block-parallel rank must own a block")
        s, n = self.canvas_start, g.num_blocks
        if not 0 <= s <= n:
            raise ValueError(f"canvas start block {s} outside [0, {n}] ({n} blocks)")
        if self.kind in ("bp", "csbp") and n - s < bp:
            raise ValueError(f"canvas of {n - s} blocks (from block {s}) is smaller than --block-parallel-size {bp}: "
                             "every block-parallel rank must own a canvas block (use canvas_layout)")
        if self.kind == "cp" and (s * g.block_size) % (2 * P):
            raise ValueError(f"canvas start block {s} x --block-size {g.block_size} must divide by 2 x {P} "
                             "context-parallel ranks (zigzag over the canvas and clean rows; use canvas_layout)")

    def canvas_layout(self, first_block: int, clean_loss: Optional[bool] = None,
                      balanced: bool = False, row_multiple: int = 1) -> "SequenceLayout":
        """This layout with noisy rows only from block `first_block` on, the start moved down to
        the nearest block this layout can place (docs/diffusiongemma.md). `balanced`: under
        BP/CSBP also down to where every block-parallel rank owns the same number of canvas blocks
        (the extra blocks carry no loss); MoE token exchange needs equal row counts.
        `row_multiple`: also down to where every rank's noisy and clean row counts divide by it
        (sequence parallelism feeds each rank's rows as TP shards of [noisy chunk | clean chunk])."""
        layout = replace(self, canvas_start=self._placeable_start(first_block, balanced),
                         clean_loss=self.clean_loss if clean_loss is None else clean_loss)
        while row_multiple > 1 and layout.canvas_start > 0 and not layout.rows_divide_by(row_multiple):
            layout = replace(layout, canvas_start=self._placeable_start(layout.canvas_start - 1, balanced))
        return layout

    def _placeable_start(self, first_block: int, balanced: bool) -> int:
        """The largest canvas start <= first_block this layout can place (never increases)."""
        g, n = self.geometry, self.geometry.num_blocks
        s = min(max(int(first_block), 0), n)
        if self.kind in ("bp", "csbp"):
            s = min(s, n - self.bp_size)
            unit = balanced_block_unit(self.bp_size, self.schedule)
            while balanced and s > 0 and (n - s) % unit:
                s -= 1
        elif self.kind == "cp":
            while (s * g.block_size) % (2 * self.shard_group_size):
                s -= 1
        return s

    def rows_divide_by(self, multiple: int) -> bool:
        """Every rank's noisy and clean row counts divide by `multiple`."""
        rows = [self.rows(rank) for rank in range(self.shard_group_size)]
        return all(int(r.is_clean.sum()) % multiple == 0 and int((~r.is_clean).sum()) % multiple == 0 for r in rows)

    # ---- sizes (kind, shard_group_size, ring_of: `ShardGroupSizes`) ----------------------------
    @property
    def ring_size(self) -> int:
        """Ranks that share one clean stream (and exchange K/V)."""
        return self.cp_size

    # ---- ownership -----------------------------------------------------------------------------
    @cached_property
    def block_owners(self) -> List[List[int]]:
        """owned blocks (sorted) of each rank; every block is owned by exactly one rank."""
        n, P, s = self.geometry.num_blocks, self.shard_group_size, self.canvas_start
        if self.kind in ("single", "cp"):
            return [list(range(s, n))] * P  # not owned per rank: CP shards rows, not blocks
        if self.block_costs is not None:
            counts = [len(p) for p in split_evenly(list(range(s, n)), self.bp_size)]
            parts = balanced_owners(list(range(s, n)), self.block_costs, counts)
        elif self.schedule == "contiguous":
            parts = split_evenly(list(range(s, n)), self.bp_size)
        else:
            # Mirrored order split first over ring positions (so, when blocks divide evenly, a rank's
            # clean shard is the clean copy of its own blocks), then over the k ring copies.
            k = self.bp_size // self.cp_size
            by_position = split_evenly([s + b for b in mirrored_order(n - s)], self.cp_size)
            subs = [split_evenly(part, k) for part in by_position]  # [ring position][ring copy]
            parts = [subs[i][j] for j in range(k) for i in range(self.cp_size)]  # rank j * cp + i
        return [sorted(p) for p in parts]

    # ---- rows ----------------------------------------------------------------------------------
    def clean_shard_positions(self, ring_position: int) -> torch.Tensor:
        """Clean positions held at `ring_position` of a ring (zigzag over 2C chunks)."""
        return zigzag_rows(self.cp_size, ring_position, self.geometry.seq_length // (2 * self.cp_size))

    def rows(self, rank: int) -> RowMeta:
        """Local rows of `rank`, ordered [noisy ; clean]."""
        L, P = self.geometry.seq_length, self.shard_group_size
        if not 0 <= rank < P:
            raise ValueError(f"rank {rank} outside the shard group of size {P}")
        kind = self.kind
        start = self.canvas_start * self.geometry.block_size
        if kind == "single":
            return RowMeta.of(torch.arange(start, L), torch.arange(L))
        if kind == "cp":
            # Zigzag over the logical rows [canvas noisy ; clean] (2L rows without a canvas):
            # rank r holds chunks r and 2P-1-r, which keeps its rows in [noisy ; clean] order.
            canvas = L - start
            logical = zigzag_rows(P, rank, (canvas + L) // (2 * P))
            is_clean = logical >= canvas
            return RowMeta(is_clean, torch.where(is_clean, logical - canvas, logical + start))
        owned = self.block_owners[rank]
        B = self.geometry.block_size
        noisy = (torch.tensor(owned, dtype=torch.long)[:, None] * B + torch.arange(B)).flatten()
        if kind == "bp":
            # The clean prefix the rank's blocks need (recomputed here, no traffic); with a clean
            # loss also the clean rows of its last block, whose loss it may count.
            last = max(owned) + (1 if self.clean_loss else 0) if owned else 0
            return RowMeta.of(noisy, torch.arange(last * B))
        return RowMeta.of(noisy, self.clean_shard_positions(self.ring_of(rank)[1]))

    def ring_clean_rows(self, rank: int) -> List[RowMeta]:
        """Clean-row metadata of each member of `rank`'s ring, in ring order (CSBP exchange)."""
        return [RowMeta.of(torch.zeros(0, dtype=torch.long), self.clean_shard_positions(i)) for i in range(self.cp_size)]

    def ring_ranks(self, rank: int) -> List[int]:
        """Sequence-group ranks of `rank`'s ring."""
        j, _ = self.ring_of(rank)
        return list(range(j * self.cp_size, (j + 1) * self.cp_size))

    def clean_loss_positions(self, rank: int) -> torch.Tensor:
        """Clean positions whose loss `rank` counts: over the shard group every clean position
        is counted exactly once, by a rank that holds it.

        single / cp: the rank's own clean rows. bp: clean block c is counted by the owner of
        block max(c, canvas start), which holds it (rows through its last owned block).
        csbp: a ring position's clean shard is held by the k rings alike; ring j counts the j-th
        of k even parts of it."""
        rows = self.rows(rank)
        clean = rows.position[rows.is_clean]
        kind = self.kind
        if kind in ("single", "cp"):
            return clean
        if kind == "bp":
            if not self.clean_loss:
                raise ValueError("under bp the clean rows of a rank's last block are only held with clean_loss=True")
            B, s = self.geometry.block_size, self.canvas_start
            owner = {b: r for r, blocks in enumerate(self.block_owners) for b in blocks}
            counted = torch.tensor([owner[max(int(p) // B, s)] == rank for p in clean], dtype=torch.bool)
            return clean[counted]
        j, _ = self.ring_of(rank)
        k = self.bp_size // self.cp_size
        parts = split_evenly(list(range(len(clean))), k)
        return clean[torch.tensor(parts[j], dtype=torch.long)]
