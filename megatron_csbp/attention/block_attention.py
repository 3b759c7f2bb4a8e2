"""Block-diffusion attention for one rank of any layout: local partials, transported partials, merge.

`block_diffusion_attention` puts the rows in local order and dispatches to the plan's strategy
(`attention.strategies`); `KVSource` lets a layer whose K and V derive from one per-row tensor
move that tensor alone. Semantics: docs/semantics.md#attention-and-the-log-sum-exp-merge; design:
docs/architecture.md#one-ranks-attention-attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_csbp.attention.strategies import AttentionCall, ExchangeStrategy, select_strategy
from megatron_csbp.layout.exchange import WindowExchangePlan
from megatron_csbp.layout.masks import AnchoredGeometry, BlockGeometry, Documents, RowMeta
from megatron_csbp.layout.rows import PartialMask, index_runs


@dataclass(frozen=True)
class KVSource:
    """K and V of a layer's rows as a function of one per-row tensor.

    `raw` [sq, b, G', d'] holds this rank's rows in the order of k and v. `derive(raw_rows,
    positions)` returns (k, v) [n, b, G, d] of rows given their `raw` rows and layout positions
    (int64 [n], on raw's device), differentiably, and equal to the k and v the owner of those
    rows computes. It must not depend on anything but its arguments and the layer's weights:
    activation recompute replays it."""

    raw: torch.Tensor
    derive: Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AttentionPlan:
    """Everything a core attention call needs beyond q, k, v: static for a (layout, rank, length)."""

    geometry: BlockGeometry
    local: RowMeta  # this rank's rows, [noisy ; clean]
    exchange: str = "none"  # 'none' | 'clean' (CSBP) | 'all' (CP baseline)
    transport: str = "allgather"  # 'allgather' | 'ring'
    group: Optional[dist.ProcessGroup] = None  # the ring that exchanges K/V
    peers: Optional[List[RowMeta]] = None  # what each ring member sends, in ring order
    members: Optional[List[RowMeta]] = None  # every ring member's local rows (its queries)
    ring_index: int = 0  # this rank's position in the ring
    # Sequence parallelism orders each TP shard [noisy | clean]; row j of the physical input is
    # local row physical_order[j]. None means the physical order is the local order.
    physical_order: Optional[torch.Tensor] = None
    # False: clean rows are keys only (DFlash context): q and the output hold the noisy rows alone.
    clean_queries: bool = True
    # Packed documents (`for_documents`): positions fed to the model restart at every document
    # (Megatron's --reset-position-ids); the mask's documents live on `geometry`.
    position_documents: Optional[Documents] = None
    # The plan this one was derived from by `for_documents` (the layout's own or a canvas plan).
    base: Optional["AttentionPlan"] = field(default=None, repr=False)
    # Masks (row vectors, with what kernels derive from them) and window plans: static, owned
    # by the plan and freed with it. Bounded: one entry per (part, window, device), parts being
    # the plan's few partials (noisy, clean, one per ring member).
    _cache: Dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        assert self.exchange in ("none", "clean", "all")
        self.num_noisy = int((~self.local.is_clean).sum())
        if self.exchange != "none":
            assert self.group is not None and self.peers is not None
        else:
            assert bool(self.local.is_clean[self.num_noisy :].all()), "local rows must be [noisy ; clean]"
        if not self.clean_queries:
            assert self.physical_order is None, "key-only clean rows are not supported with sequence parallelism"
        # The exchange strategy of full-attention and of sliding-window layers, chosen once.
        self.strategy: ExchangeStrategy = select_strategy(self.exchange, self.transport, windowed=False)
        self.window_strategy: ExchangeStrategy = select_strategy(self.exchange, self.transport, windowed=True)

    def strategy_for(self, window: Optional[int]) -> ExchangeStrategy:
        """The exchange strategy of a layer with sliding window `window` (None: full attention).
        With packed documents every layer takes the windowed strategy: its exchange moves only
        the clean rows inside some local query's interval, and a document cuts the intervals
        (other documents' clean rows never move)."""
        # (DFlash's AnchoredGeometry has no documents: its blocks carry their own document starts)
        if window is None and getattr(self.geometry, "documents", None) is None:
            return self.strategy
        return self.window_strategy

    def for_documents(self, documents: Optional[Documents], *, mask: bool = True,
                      reset_position_ids: bool = False) -> "AttentionPlan":
        """This plan for one packed sample: attention kept inside `documents` (`mask`, Megatron's
        --reset-attention-mask) and/or model positions restarting at each document
        (`reset_position_ids`). A new plan with its own mask cache (the rows, ring and strategy
        are this plan's); `self` when nothing changes."""
        if documents is None or (not mask and not reset_position_ids):
            return self
        geometry = self.geometry.with_documents(documents) if mask else self.geometry
        return replace(self, geometry=geometry, position_documents=documents if reset_position_ids else None,
                       base=self.base or self, _cache={})

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The positions the model (rotary, position ids) sees for rows at layout `positions`:
        the same, or with --reset-position-ids the offset inside the row's document."""
        if self.position_documents is None:
            return positions
        return positions - self.position_documents.start_of(positions)

    @property
    def num_query_rows(self) -> int:
        """Rows of q (and of the output) this plan expects."""
        return len(self.local) if self.clean_queries else self.num_noisy

    def cached(self, key, build: Callable):
        """`build()`, built once per `key` and kept in the plan's cache (static, as the plan is)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def window_exchange(self, geometry: BlockGeometry) -> WindowExchangePlan:
        """The static windowed clean exchange of this rank for a sliding-window layer."""
        return self.cached(("window_exchange", geometry.window),
                           lambda: WindowExchangePlan.build(self.members, self.peers, geometry, self.ring_index))

    def mask(self, key: Tuple, q: RowMeta, k: RowMeta, geometry: BlockGeometry, device):
        """(`PartialMask` over the keys any query may see, their indices or None when all are),
        cached per (part, window): the metadata is static, so masks are built once. The keys
        seen come from the queries' interval union (`PartialMask.keys_seen`), never a dense
        mask. Dropping keys no query sees (other ranks' noisy rows under CP, clean rows past
        every local block) saves moving them into the kernel."""
        def build():
            m = PartialMask.of(q, k, geometry)
            used = m.keys_seen()
            if bool(used.all()):
                return m.to(device), None
            cols = used.nonzero().flatten()
            return PartialMask(m.q, m.k.select(cols)).to(device), cols.to(device)

        return self.cached(key + (geometry.window, str(device)), build)

    def gathered_runs(self) -> List[slice]:
        """Runs of the all-gathered clean rows (every ring member's shard, in ring order) that put
        them in position order when concatenated: in ring order a clean prefix lies in up to 2C
        runs (mirrored shards) and the kernel makes a call per run, so the rank holding the last
        blocks made 2-3x the calls of the one holding the middle ones. Cached (static); slices
        only, at most 2 per ring member."""
        positions = lambda: RowMeta.cat(self.peers).position  # noqa: E731
        return self.cached("gathered_runs", lambda: index_runs(torch.argsort(positions(), stable=True)))

    def block_diagonal_mask(self, device) -> PartialMask:
        """The B x B all-allowed mask of the folded block-diagonal noisy attention (row vectors)."""
        build = lambda: PartialMask.block_diagonal(self.geometry.block_size, device)  # noqa: E731
        return self.cached(("block_diagonal", str(device)), build)

    def nbytes(self) -> int:
        """Bytes this plan keeps for its masks: row vectors plus derived tile tables/schedules."""
        masks = (value[0] if isinstance(value, tuple) else value for value in self._cache.values())
        return sum(mask.nbytes + mask.derived_nbytes() for mask in masks if isinstance(mask, PartialMask))

    def positions(self, key: Tuple, rows: RowMeta, device) -> torch.Tensor:
        """`rows.position` on `device`, cached under `key` (static, as the masks are)."""
        build = lambda: self.model_positions(rows.position).to(device)  # noqa: E731
        return self.cached(("positions",) + key + (str(device),), build)

    @cached_property
    def noisy_rows_are_whole_blocks(self) -> bool:
        """Local noisy rows are complete blocks in order (BP, CSBP, single): the noisy part is
        block-diagonal and runs as a batch of dense B x B attentions."""
        B = self.geometry.block_size
        pos = self.local.position[: self.num_noisy]
        if self.num_noisy % B:
            return False
        if isinstance(self.geometry, AnchoredGeometry):
            anchor = self.local.anchor[: self.num_noisy].view(-1, B)
            return bool((anchor == anchor[:, :1]).all() and (pos.view(-1, B) - anchor == torch.arange(B)).all())
        starts = pos.view(-1, B)
        whole = bool((starts % B == torch.arange(B)).all() and (starts // B == starts[:, :1] // B).all())
        docs = self.geometry.documents
        if whole and docs is not None:  # a block split by a document boundary is not one B x B problem
            whole = bool((docs.start_of(starts[:, 0]) == docs.start_of(starts[:, -1])).all())
        return whole


def block_diffusion_attention(q, k, v, plan: AttentionPlan, *, softmax_scale: float, kernel, window=None, layer: int = 0,
                              kv_source: Optional[KVSource] = None):
    """q [sq, b, H, d], k/v [sq, b, G, d] for this rank's local rows; returns [sq, b, H, d].

    Dispatches to the plan's exchange strategy for this layer (`plan.strategy_for(window)`, see
    `attention.strategies`) after putting the rows in the plan's local order.
    `kv_source`: optional `KVSource` of the same rows; the clean exchange (CSBP) then moves its
    raw rows instead of K and V. Ignored by the other exchanges."""
    if kv_source is not None and kv_source.raw.shape[:2] != k.shape[:2]:
        raise ValueError(f"K/V source has rows {tuple(kv_source.raw.shape[:2])}, k has {tuple(k.shape[:2])}")
    if q.shape[0] != plan.num_query_rows:
        raise RuntimeError(f"q has {q.shape[0]} rows, the plan expects {plan.num_query_rows}")
    strategy = plan.strategy_for(window)
    if not strategy.moves_kv_source:
        kv_source = None
    geometry = plan.geometry.with_window(window) if window != plan.geometry.window else plan.geometry
    to_local = None
    if plan.physical_order is not None:
        to_local = torch.argsort(plan.physical_order).to(q.device)
        q, k, v = q[to_local], k[to_local], v[to_local]
        if kv_source is not None:
            kv_source = replace(kv_source, raw=kv_source.raw[to_local])
    call = AttentionCall(plan, q, k, v, geometry=geometry, kernel=kernel, softmax_scale=softmax_scale, layer=layer,
                         kv_source=kv_source, own_kv=strategy.saves_local_kv)
    out = strategy.attend(call)
    return out if to_local is None else out[plan.physical_order.to(q.device)]


def plan_for_layout(layout, rank: int = 0, group=None, transport: str = "allgather") -> AttentionPlan:
    """The attention plan of `rank` (in the shard group) under `layout`.

    `group` is the ring that exchanges K/V: the CP ring for CSBP, the whole group for CP.
    """
    kind = layout.kind
    local = layout.rows(rank)
    if kind in ("single", "bp"):
        return AttentionPlan(layout.geometry, local)
    if group is None:
        raise ValueError(f"layout {kind!r} needs the K/V ring process group")
    if dist.get_world_size(group) != layout.ring_size:
        raise ValueError(f"ring group has {dist.get_world_size(group)} ranks, layout expects {layout.ring_size}")
    ring_index = layout.ring_of(rank)[1]
    members = [local if i == ring_index else layout.rows(r) for i, r in enumerate(layout.ring_ranks(rank))]
    if kind == "cp":
        return AttentionPlan(layout.geometry, local, "all", transport, group, members, members, ring_index)
    peers = [_clean_tail(m, p) for m, p in zip(members, layout.ring_clean_rows(rank))]
    return AttentionPlan(layout.geometry, local, "clean", transport, group, peers, members, ring_index)


def _clean_tail(member: RowMeta, shard: RowMeta) -> RowMeta:
    """A ring member's clean shard as a view of the member's rows when they end with it (rows are
    [noisy ; clean]; CSBP with one ring), else `shard`: the plan then keeps one copy of the ring's
    row metadata (9 bytes per clean row of the sequence, 2.3 MiB at 256K tokens, on every rank)."""
    n = len(member) - len(shard)
    if n < 0 or member.anchor is not None or shard.anchor is not None:
        return shard
    tail = member.select(slice(n, None))
    same = torch.equal(tail.position, shard.position) and torch.equal(tail.is_clean, shard.is_clean)
    return tail if same else shard
