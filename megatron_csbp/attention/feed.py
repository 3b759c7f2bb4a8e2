"""Feeding this rank's rows of a `SequenceLayout` to the model: `RowFeeder`, which owns everything
that follows from (layout, shard rank): plans (own, AR, cached canvases), counted clean rows, a
noised batch's rows, and the TP sequence-parallel order; static metadata, no collective
(docs/semantics.md#rows).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch

from megatron_csbp.attention.block_attention import AttentionPlan, plan_for_layout
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, RowMeta
from megatron_csbp.layout.packing import block_costs


# Canvas plans kept besides the model's own plan (LRU). Each is linear in the local rows (row
# vectors, tile tables), so the bound keeps their total at a few plans' worth.
# (256K tokens on a 16-rank shard group: ~2 x 256K / 16 = 32K rows a rank, ~0.3 MB of int64
# positions + flags a plan before its tile tables; the start map holds at most one int pair per
# block, 64K at block size 4.)
CANVAS_PLAN_CACHE = 4


@dataclass
class OutputRows:
    """Which fed rows reach the output layer (read by `BlockDiffusionModel`'s output-layer hooks)."""

    count: Optional[int]  # the first `count` rows of this TP shard (its noisy rows); None: every row
    keep: Optional[torch.Tensor] = None  # instead of `count`: these rows of this TP shard, in order
    gathered_order: Optional[torch.Tensor] = None  # sequence parallelism: all-gathered rows -> requested order


@dataclass
class FedRows:
    """What goes into the GPT model: ids and positions in physical row order."""

    input_ids: torch.Tensor  # [b, rows]
    positions: torch.Tensor  # [rows]
    output: OutputRows


@dataclass
class LossRows:
    """This rank's rows of a noised batch."""

    input_ids: torch.Tensor  # [b, rows] in local row order (plan.local)
    num_noisy: int
    logit_rows: Optional[torch.Tensor]  # rows that reach the output layer; None: the noisy rows (AR: all)
    targets: torch.Tensor  # [b, logit rows]
    weights: torch.Tensor  # [b, logit rows]


class RowFeeder:
    def __init__(self, layout: SequenceLayout, shard_rank: int = 0, ring_group=None, transport: str = "allgather",
                 noisy_stream: bool = True, tp_shards: int = 1, tp_rank: int = 0):
        self.layout, self.shard_rank, self.ring_group, self.transport = layout, shard_rank, ring_group, transport
        self.noisy_stream, self.tp_shards, self.tp_rank = noisy_stream, tp_shards, tp_rank
        if noisy_stream:
            plan, self.replication = plan_for_layout(layout, shard_rank, ring_group, transport), 1
        else:
            plan, self.replication = autoregressive_plan(layout, shard_rank, ring_group, transport)
        self.plan: AttentionPlan = self._sharded(plan)
        # Canvas start -> plan, least recently used first; the own plan is never evicted.
        self._plans: "OrderedDict[int, AttentionPlan]" = OrderedDict({layout.canvas_start: self.plan})
        self._canvas_starts: Dict[int, int] = {}  # first response block -> canvas start (ints, <= blocks)
        self._counted_clean: Dict[int, torch.Tensor] = {}  # canvas start -> counted rows, same keys

    # ---- canvas plans ----------------------------------------------------------------------------
    def canvas_plan(self, first_block: int, balanced: bool = False) -> AttentionPlan:
        """This rank's plan when noisy rows start at block `first_block` (moved down where the
        layout needs it, see `SequenceLayout.canvas_layout`; `balanced`: as many rows on every
        block-parallel rank, for expert-parallel peers); built once per start and kept in an
        LRU cache of `CANVAS_PLAN_CACHE` plans (the own plan always stays)."""
        first_block = int(first_block)
        if first_block not in self._canvas_starts:
            layout = self.layout.canvas_layout(first_block, balanced=balanced, row_multiple=self.tp_shards)
            self._canvas_starts[first_block] = layout.canvas_start
        s = self._canvas_starts[first_block]
        if s not in self._plans:
            self._plans[s] = self._plan(self.layout.canvas_layout(s))
            while len(self._plans) > CANVAS_PLAN_CACHE + 1:  # evict the least recently used (not the own plan)
                oldest = next(start for start in self._plans if start != self.layout.canvas_start)
                del self._plans[oldest]
                self._counted_clean.pop(oldest, None)
        self._plans.move_to_end(s)
        return self._plans[s]

    def _plan(self, layout: SequenceLayout) -> AttentionPlan:
        """This rank's plan of `layout` (its rows shard-major under sequence parallelism)."""
        return self._sharded(plan_for_layout(layout, self.shard_rank, self.ring_group, self.transport))

    def _sharded(self, plan: AttentionPlan) -> AttentionPlan:
        if self.tp_shards > 1:
            plan.physical_order = shard_major_order(plan.local, self.tp_shards)
        return plan

    def counted_clean_rows(self, plan: AttentionPlan) -> torch.Tensor:
        """Indices (into the plan's clean rows) of the clean rows whose loss this rank counts."""
        plan = plan.base or plan  # a packed sample's plan counts the rows of the plan it came from
        start = next((s for s, p in self._plans.items() if p is plan), None)
        if start is None:
            raise KeyError("plan not built by this feeder")
        if start not in self._counted_clean:
            clean_pos = plan.local.position[plan.local.is_clean]
            counted = self.layout.canvas_layout(start).clean_loss_positions(self.shard_rank)
            self._counted_clean[start] = torch.nonzero(torch.isin(clean_pos, counted)).flatten()
        return self._counted_clean[start]

    # ---- packed samples ----------------------------------------------------------------------------
    def packed_plan(self, plan: AttentionPlan, packing, tokens: torch.Tensor,
                    document_ids: Optional[torch.Tensor] = None) -> AttentionPlan:
        """`plan` for one packed sample (`layout.packing.Packing`; clean tokens [L], or its
        document ids). Under BP with --reset-attention-mask the layout's own plan is first rebuilt
        with blocks owned by their cost in this sample (`SequenceLayout.block_costs`: a block's
        cost follows its position in its document, not in the sequence; each rank keeps its block
        count, so row counts and collectives are unchanged). Not under CSBP: there moving blocks
        away from the clean shard that holds their documents multiplies the clean exchange
        (docs/benchmarks/packing.md: spread 1.54 -> 1.27 for 5.9x the rows at 4K, 4 x 4), so CSBP
        keeps the layout's ownership. Built per sample: linear in the rows, like the plan."""
        if not packing.splits_documents:
            return plan
        docs = packing.documents(tokens, document_ids)
        layout = self.layout
        if (packing.reset_attention_mask and plan is self.plan and self.noisy_stream and len(docs) > 1
                and layout.kind == "bp" and not layout.clean_loss):
            g = layout.geometry
            plan = self._plan(replace(layout, block_costs=block_costs(docs, g.block_size, g.seq_length)))
        return plan.for_documents(docs, mask=packing.reset_attention_mask,
                                  reset_position_ids=packing.reset_position_ids)

    # ---- rows of a batch ---------------------------------------------------------------------------
    def check_sequence_length(self, tokens: torch.Tensor) -> None:
        L = tokens.shape[1]
        if L != self.layout.geometry.seq_length:
            raise ValueError(f"batch has sequence length {L}, the layout was built for --seq-length "
                             f"{self.layout.geometry.seq_length}")

    def rows(self, plan: AttentionPlan, noised, tokens: torch.Tensor) -> LossRows:
        """This rank's rows under `plan` of a `NoisedBatch` of `tokens` [b, L]: the ids (clean rows
        from the clean stream, noisy rows from the noisy one), and the target rows: the noisy
        rows, or (AR) the clean rows; with clean-row targets one set of rows [noisy rows ;
        counted clean rows with a target in the batch] (one cross entropy over both: Megatron's
        vocab-parallel CE works in place on its input, so two calls on slices of the same logits
        would clash in backward)."""
        if noised.clean_tokens is not None:
            tokens = noised.clean_tokens
        pos = plan.local.position.to(tokens.device)
        is_clean = plan.local.is_clean.to(tokens.device)
        input_ids = torch.where(is_clean[None], tokens[:, pos], noised.noisy_tokens[:, pos])
        n = plan.num_noisy
        if noised.clean_targets is None:
            target_pos = pos[~is_clean] if self.noisy_stream else pos
            return LossRows(input_ids, n, None, noised.targets[:, target_pos], noised.weights[:, target_pos])
        if not self.noisy_stream:
            raise ValueError("clean-row targets need an objective with a noisy stream")
        clean_pos = pos[n:]
        counted = self.counted_clean_rows(plan).to(pos.device)
        has_target = (noised.clean_targets[:, clean_pos[counted]] >= 0).any(dim=0)
        chosen = counted[has_target]
        logit_rows = torch.cat([torch.arange(n, device=pos.device), n + chosen])
        noisy_pos, target_clean = pos[:n], clean_pos[chosen]
        targets = torch.cat([noised.targets[:, noisy_pos], noised.clean_targets[:, target_clean]], dim=1)
        weights = torch.cat([noised.weights[:, noisy_pos], noised.clean_weights[:, target_clean]], dim=1)
        return LossRows(input_ids, n, logit_rows, targets, weights)

    def feed(self, plan: AttentionPlan, tokens: torch.Tensor, logit_rows: Optional[torch.Tensor] = None) -> FedRows:
        """Ids [b, rows] in local row order under `plan` -> what the GPT model gets: ids and
        positions in physical order (shard-major under sequence parallelism, so that every TP
        rank drops its clean rows alike before the output layer) and the rows that reach the
        output layer: the noisy rows (every row when there are none, AR), or `logit_rows` (local
        row indices: every noisy row in order, then chosen clean rows) in that order."""
        rows = plan.local
        num_noisy = plan.num_noisy
        positions = plan.model_positions(rows.position).to(tokens.device)
        keep, gathered_order = logit_rows, None
        if plan.physical_order is not None:
            if logit_rows is not None:
                per_shard, gathered_order = sequence_parallel_logit_rows(
                    num_noisy, len(rows) - num_noisy, logit_rows, self.tp_shards)
                keep = per_shard[self.tp_rank]
            order = plan.physical_order.to(tokens.device)
            tokens, positions = tokens[:, order], positions[order]
        count = num_noisy // self.tp_shards if num_noisy else None
        return FedRows(tokens, positions, OutputRows(count, keep, gathered_order))


def autoregressive_plan(layout: SequenceLayout, shard_rank: int, ring_group, transport: str):
    """Clean stream only, token-causal: each ring holds a zigzag copy of the stream (CP ranks), so
    AR runs under every layout. Returns (plan, number of rings that compute the same loss)."""
    g = layout.geometry
    geometry = BlockGeometry(g.seq_length, g.block_size, "token_causal", g.window)
    empty = torch.zeros(0, dtype=torch.long)
    if layout.ring_size == 1:
        plan = AttentionPlan(geometry, RowMeta.of(empty, torch.arange(g.seq_length)))
    else:
        ring_position = layout.ring_of(shard_rank)[1]
        local = RowMeta.of(empty, layout.clean_shard_positions(ring_position))
        shards = layout.ring_clean_rows(shard_rank)
        plan = AttentionPlan(geometry, local, "clean", transport, ring_group, shards, shards, ring_position)
    return plan, layout.shard_group_size // layout.ring_size


def shard_major_order(rows: RowMeta, shards: int) -> torch.Tensor:
    """Physical order for sequence parallelism: shard i holds [noisy chunk i | clean chunk i]."""
    n = int((~rows.is_clean).sum())
    c = len(rows) - n
    if n % shards or c % shards:
        raise ValueError(f"--sequence-parallel with --tensor-model-parallel-size {shards} needs this rank's {n} noisy "
                         f"and {c} clean rows to divide by {shards} (choose --seq-length/--block-size accordingly)")
    return torch.cat([torch.arange(n).view(shards, -1), n + torch.arange(c).view(shards, -1)], dim=1).flatten()


def sequence_parallel_logit_rows(num_noisy: int, num_clean: int, logit_rows: torch.Tensor, shards: int):
    """The rows each TP shard keeps before the output layer when the rows are fed shard-major
    (`shard_major_order`) and `logit_rows` = [every noisy row in local order ; chosen clean rows]
    (local indices) must reach it. Returns (keep, order):

    - keep[i]: indices into shard i's rows: its noisy chunk, then the chosen clean rows of its
      clean chunk (in the given order), then padding (the shard's first row) up to k = the largest
      count over shards, at least 1, so that the sequence-parallel all-gather sees equal sizes;
    - order: indices into the gathered [shards * k] rows giving the logits in `logit_rows` order
      (padding dropped).

    Static metadata of (row counts, chosen rows): every TP rank computes the same, no collective."""
    n, c = int(num_noisy), int(num_clean)
    if n % shards or c % shards:
        raise ValueError(f"{n} noisy and {c} clean rows do not divide by {shards} sequence-parallel shards")
    nc, cc = n // shards, c // shards
    rows = logit_rows.detach().to("cpu", torch.long)
    if len(rows) < n or not torch.equal(rows[:n], torch.arange(n)):
        raise ValueError("under sequence parallelism logit_rows must start with every noisy row in local order")
    clean = rows[n:] - n
    if len(clean) and (int(clean.min()) < 0 or int(clean.max()) >= c):
        raise ValueError(f"logit_rows name clean rows outside [0, {c})")
    if len(torch.unique(clean)) != len(clean):
        raise ValueError("logit_rows name a clean row twice")
    shard_of = torch.div(clean, cc, rounding_mode="floor") if cc else clean
    counts = torch.bincount(shard_of, minlength=shards) if len(clean) else torch.zeros(shards, dtype=torch.long)
    k = max(nc + int(counts.max()), 1)
    keep, clean_slot = [], torch.empty(len(clean), dtype=torch.long)
    for i in range(shards):
        mine = torch.nonzero(shard_of == i).flatten()
        pad = torch.zeros(k - nc - len(mine), dtype=torch.long)
        keep.append(torch.cat([torch.arange(nc), nc + clean[mine] - i * cc, pad]))
        clean_slot[mine] = i * k + nc + torch.arange(len(mine))
    noisy = torch.arange(n)
    noisy_slot = (noisy // nc) * k + noisy % nc if nc else noisy
    return keep, torch.cat([noisy_slot, clean_slot])
