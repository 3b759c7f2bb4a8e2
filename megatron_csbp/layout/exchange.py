"""Static exchange plans for sliding-window layers under CSBP.

A sliding-window layer needs only the clean rows inside the windows: for each owned noisy block
the W-1 clean rows before it, for each local clean query the W-1 rows before it. Which rows of
which ring member those are follows from the metadata alone, so every rank computes the same
plan: what it sends to each member (indices into its clean shard) and what it receives from
each. One variable-split all-to-all moves exactly those rows; backward runs it in reverse.

The rows needed come from the queries' clean-key intervals (a difference array over positions,
`PartialMask.keys_seen`): O(queries + shard + span) per member, never a [queries x shard] mask.
The plan itself is linear in the rows it moves (one index per row).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from megatron_csbp.layout.masks import BlockGeometry, RowMeta
from megatron_csbp.layout.rows import PartialMask


def needed_clean_rows(queries: RowMeta, shard: RowMeta, geometry: BlockGeometry) -> torch.Tensor:
    """Indices of `shard`'s (clean) rows that any of `queries` may attend."""
    if len(queries) == 0 or len(shard) == 0:
        return torch.zeros(0, dtype=torch.long)
    return PartialMask.of(queries, shard, geometry).keys_seen().nonzero().flatten()


@dataclass(frozen=True)
class WindowExchangePlan:
    me: int  # position in the ring
    send_index: List[torch.Tensor]  # per member: indices into my clean shard it needs
    recv_rows: List[RowMeta]  # per member: metadata of the rows it sends me (empty for me)

    @staticmethod
    def build(members: List[RowMeta], shards: List[RowMeta], geometry: BlockGeometry, me: int) -> "WindowExchangePlan":
        """`members[i]`: all local rows (queries) of ring member i; `shards[i]`: its clean rows."""
        none = torch.zeros(0, dtype=torch.long)
        send_index = [none if i == me else needed_clean_rows(m, shards[me], geometry) for i, m in enumerate(members)]
        recv_rows = [s.select(none if i == me else needed_clean_rows(members[me], s, geometry))
                     for i, s in enumerate(shards)]
        return WindowExchangePlan(me, send_index, recv_rows)

    @property
    def send_counts(self) -> List[int]:
        return [len(ix) for ix in self.send_index]

    @property
    def recv_counts(self) -> List[int]:
        return [len(r) for r in self.recv_rows]
