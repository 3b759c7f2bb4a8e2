"""Where a DFlash drafter's rows (draft blocks and projected context) live under single, CP, BP and
CSBP, and how anchors are dealt over ranks (docs/dflash.md#layouts-megatron_csbplayoutdflashpy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_csbp.attention.block_attention import AttentionPlan
from megatron_csbp.layout.layout import zigzag_rows
from megatron_csbp.layout.sizes import ShardGroupSizes, check_parallel_sizes
from megatron_csbp.layout.masks import AnchoredGeometry, RowMeta


def deal_anchors(costs: torch.Tensor, ranks: int) -> List[torch.Tensor]:
    """Indices of the anchors each rank owns: sorted by cost (largest first), paired largest
    with smallest, pairs dealt round-robin; each rank's indices in increasing order."""
    order = torch.sort(costs, descending=True, stable=True).indices.tolist()
    n = len(order)
    owned: List[List[int]] = [[] for _ in range(ranks)]
    for j in range((n + 1) // 2):
        owned[j % ranks].extend({order[j], order[n - 1 - j]})  # the pair (one anchor in the middle)
    return [torch.tensor(sorted(o), dtype=torch.long) for o in owned]


def needed_context(anchors: torch.Tensor, doc_starts: torch.Tensor, seq_length: int) -> torch.Tensor:
    """[L] bool: positions inside some anchor's [document start, anchor) (difference array, O(L + A))."""
    diff = torch.bincount(doc_starts, minlength=seq_length + 1) - torch.bincount(anchors, minlength=seq_length + 1)
    return torch.cumsum(diff[:-1], 0) > 0


@dataclass(frozen=True)
class DFlashLayout(ShardGroupSizes):
    seq_length: int
    block_size: int
    cp_size: int = 1
    bp_size: int = 1

    def __post_init__(self):
        check_parallel_sizes(self.cp_size, self.bp_size)
        if self.kind in ("cp", "csbp") and self.seq_length % (2 * self.cp_size):
            raise ValueError(f"--seq-length {self.seq_length} must be divisible by 2 x --context-parallel-size "
                             f"{self.cp_size} (the context is zigzag-sharded into {2 * self.cp_size} chunks)")

    def owned(self, anchors: torch.Tensor, doc_starts: torch.Tensor) -> List[torch.Tensor]:
        """Per rank of the shard group: indices of the anchors it owns."""
        if self.kind == "single":
            return [torch.arange(len(anchors))]
        return deal_anchors(anchors - doc_starts, self.shard_group_size)

    def context_positions(self, rank: int, anchors, doc_starts, owned) -> torch.Tensor:
        L = self.seq_length
        if self.kind in ("single", "bp"):
            mine = owned[rank]
            return needed_context(anchors[mine], doc_starts[mine], L).nonzero().flatten()
        # cp / csbp: the whole zigzag shard of this ring position (equal row counts on every ring
        # member, as the all-gather and ring transports need).
        return zigzag_rows(self.cp_size, self.ring_of(rank)[1], L // (2 * self.cp_size))

    def padded_blocks(self, owned) -> int:
        """Draft blocks per rank: under CP (all rows exchanged) every rank holds as many blocks as
        the busiest one, the rest padding blocks (a distinct negative anchor each: they see only
        themselves, nobody sees them, they carry no loss)."""
        return max(len(o) for o in owned) if self.kind == "cp" else 0

    def rows(self, rank: int, anchors, doc_starts, position_doc_starts, owned=None) -> RowMeta:
        """Local rows of `rank`: [owned draft blocks (+ padding blocks) ; context rows]."""
        owned = self.owned(anchors, doc_starts) if owned is None else owned
        mine = owned[rank]
        ctx = self.context_positions(rank, anchors, doc_starts, owned)
        pad = max(self.padded_blocks(owned) - len(mine), 0)
        a = torch.cat([anchors[mine], -2 - torch.arange(pad)])
        s = torch.cat([doc_starts[mine], torch.zeros(pad, dtype=torch.long)])
        return RowMeta.anchored(a, s, self.block_size, ctx, position_doc_starts[ctx])

    def plan(self, rank: int, anchors, doc_starts, position_doc_starts, group=None, transport: str = "allgather",
             window: Optional[int] = None) -> AttentionPlan:
        """The anchored attention plan of `rank`; `group` is the K/V ring (the CP ring under CSBP,
        the whole shard group under CP)."""
        geometry = AnchoredGeometry(self.block_size, window)
        owned = self.owned(anchors, doc_starts)
        local = self.rows(rank, anchors, doc_starts, position_doc_starts, owned)
        kind = self.kind
        if kind in ("single", "bp"):
            return AttentionPlan(geometry, local, clean_queries=False)
        if group is None or dist.get_world_size(group) != self.cp_size:
            raise ValueError(f"layout {kind!r} needs the K/V ring process group of {self.cp_size} ranks")
        j, i = self.ring_of(rank)
        ring = range(j * self.cp_size, (j + 1) * self.cp_size)
        members = [self.rows(r, anchors, doc_starts, position_doc_starts, owned) for r in ring]
        if kind == "cp":
            return AttentionPlan(geometry, local, "all", transport, group, members, members, i, clean_queries=False)
        peers = [m.select(slice(int((~m.is_clean).sum()), None)) for m in members]  # their clean rows
        return AttentionPlan(geometry, local, "clean", transport, group, peers, members, i, clean_queries=False)
