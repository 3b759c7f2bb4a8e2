"""Block-diffusion attention for one rank of any layout: local partials, transported partials, merge.

Clean exchange (single, BP, CSBP): local rows are [noisy ; clean]. Noisy queries attend their own
block on this rank (block-diagonal, never moves) and clean keys; clean keys are this rank's own
(single, BP) or the ring's shards (CSBP: all-gathered while the noisy part runs, or ring-streamed;
on sliding-window layers only the rows inside the windows move, by one all-to-all).
Full exchange (CP baseline): K/V of all local rows are exchanged and every query attends every
chunk under the same predicate.

K/V sources: a layer whose K and V are both functions of one per-row tensor (DiffusionGemma's K=V
layers: V = v_norm(raw k), K = rope(k_norm(raw k))) may pass a `KVSource`. The clean exchange then
moves that tensor alone (half the bytes of K and V when it has K's width) and each receiver
derives K and V of the rows it got at their layout positions; its own rows keep the K and V it
was given. The CP baseline keeps moving K and V: it stands for Megatron's CP, which has no such
notion.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_csbp.attention.kernels import PartialMerge, merge_partials
from megatron_csbp.attention.transports import PendingAllToAll, PendingGather, pack_kv, ring_chunks, unpack_kv
from megatron_csbp.layout.exchange import WindowExchangePlan
from megatron_csbp.layout.masks import AnchoredGeometry, BlockGeometry, RowMeta
from megatron_csbp.layout.rows import PartialMask


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
    # Masks (row vectors, with what kernels derive from them) and window plans: static, owned
    # by the plan and freed with it. Bounded: one entry per (part, window, device), parts being
    # the plan's few partials (noisy, clean, one per ring member).
    _cache: Dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        assert self.exchange in ("none", "clean", "all")
        self.num_noisy = int((~self.local.is_clean).sum())
        if self.exchange != "none":
            assert self.group is not None and self.peers is not None
        if self.exchange == "none":
            assert bool(self.local.is_clean[self.num_noisy :].all()), "local rows must be [noisy ; clean]"
        if not self.clean_queries:
            assert self.physical_order is None, "key-only clean rows are not supported with sequence parallelism"

    @property
    def num_query_rows(self) -> int:
        """Rows of q (and of the output) this plan expects."""
        return len(self.local) if self.clean_queries else self.num_noisy

    def window_exchange(self, geometry: BlockGeometry) -> WindowExchangePlan:
        """The static windowed clean exchange of this rank for a sliding-window layer."""
        key = ("window_exchange", geometry.window)
        if key not in self._cache:
            self._cache[key] = WindowExchangePlan.build(self.members, self.peers, geometry, self.ring_index)
        return self._cache[key]

    def mask(self, key: Tuple, q: RowMeta, k: RowMeta, geometry: BlockGeometry, device):
        """(`PartialMask` over the keys any query may see, their indices or None when all are),
        cached per (part, window): the metadata is static, so masks are built once. The keys
        seen come from the queries' interval union (`PartialMask.keys_seen`), never a dense
        mask. Dropping keys no query sees (other ranks' noisy rows under CP, clean rows past
        every local block) saves moving them into the kernel."""
        cache_key = key + (geometry.window, str(device))
        if cache_key not in self._cache:
            m = PartialMask.of(q, k, geometry)
            used = m.keys_seen()
            if bool(used.all()):
                self._cache[cache_key] = (m.to(device), None)
            else:
                cols = used.nonzero().flatten()
                self._cache[cache_key] = (m.select_keys(cols).to(device), cols.to(device))
        return self._cache[cache_key]

    def block_diagonal_mask(self, device) -> PartialMask:
        """The B x B all-allowed mask of the folded block-diagonal noisy attention (row vectors)."""
        cache_key = ("block_diagonal", str(device))
        if cache_key not in self._cache:
            self._cache[cache_key] = PartialMask.block_diagonal(self.geometry.block_size, device)
        return self._cache[cache_key]

    def nbytes(self) -> int:
        """Bytes this plan keeps for its masks: row vectors plus derived tile tables/schedules."""
        total = 0
        for value in self._cache.values():
            mask = value[0] if isinstance(value, tuple) else value
            if isinstance(mask, PartialMask):
                total += mask.nbytes + mask.derived_nbytes()
        return total

    def positions(self, key: Tuple, rows: RowMeta, device) -> torch.Tensor:
        """`rows.position` on `device`, cached under `key` (static, as the masks are)."""
        cache_key = ("positions",) + key + (str(device),)
        if cache_key not in self._cache:
            self._cache[cache_key] = rows.position.to(device)
        return self._cache[cache_key]

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
        return bool((starts % B == torch.arange(B)).all() and (starts // B == starts[:, :1] // B).all())


def block_diffusion_attention(q, k, v, plan: AttentionPlan, *, softmax_scale: float, kernel, window=None, layer: int = 0,
                              kv_source: Optional[KVSource] = None):
    """q [sq, b, H, d], k/v [sq, b, G, d] for this rank's local rows; returns [sq, b, H, d].

    `kv_source`: optional `KVSource` of the same rows; the clean exchange (CSBP) then moves its
    raw rows instead of K and V. Ignored by the other exchanges."""
    if kv_source is not None and kv_source.raw.shape[:2] != k.shape[:2]:
        raise ValueError(f"K/V source has rows {tuple(kv_source.raw.shape[:2])}, k has {tuple(k.shape[:2])}")
    if plan.exchange != "clean":
        kv_source = None
    if plan.physical_order is not None:
        to_local = torch.argsort(plan.physical_order).to(q.device)
        if kv_source is not None:
            kv_source = replace(kv_source, raw=kv_source.raw[to_local])
        out = _block_diffusion_attention(q[to_local], k[to_local], v[to_local], plan, softmax_scale=softmax_scale,
                                         kernel=kernel, window=window, layer=layer, kv_source=kv_source)
        return out[plan.physical_order.to(q.device)]
    return _block_diffusion_attention(q, k, v, plan, softmax_scale=softmax_scale, kernel=kernel, window=window,
                                      layer=layer, kv_source=kv_source)


def _block_diffusion_attention(q, k, v, plan: AttentionPlan, *, softmax_scale: float, kernel, window=None, layer: int = 0,
                               kv_source: Optional[KVSource] = None):
    geometry = plan.geometry.with_window(window) if window != plan.geometry.window else plan.geometry
    device = q.device
    local = plan.local
    if q.shape[0] != plan.num_query_rows:
        raise RuntimeError(f"q has {q.shape[0]} rows, the plan expects {plan.num_query_rows}")
    # Query metadata: every local row, or the noisy rows alone when clean rows are keys only.
    queries = local if plan.clean_queries else local.select(slice(0, plan.num_noisy))

    # Chunks that arrived over the network but have no allowed pair are skipped; they stay tied
    # to the output with a zero so that every rank runs the same backward collectives.
    anchors = []

    def partial(tag, q_rows, k_rows, q_, k_, v_):
        m, cols = plan.mask(tag, q_rows, k_rows, geometry, device)
        if m.shape[1] == 0:
            if k_.requires_grad:
                anchors.append(k_.sum() + v_.sum())
            return None
        if cols is not None:
            k_, v_ = k_.index_select(0, cols), v_.index_select(0, cols)
        return kernel(q_, k_, v_, m, softmax_scale)

    def tie(out):
        for a in anchors:
            out = out + 0.0 * a
        return out

    if plan.exchange == "all":
        # CP baseline: every row's K/V crosses ranks.
        kv = pack_kv(k, v)
        parts = PartialMerge()  # ring chunks merge as they arrive: one accumulator in flight
        if plan.transport == "allgather":
            gathered = PendingGather(kv, plan.group, layer).result()
            gk, gv = unpack_kv(gathered)
            part = partial(("all",), queries, RowMeta.cat(plan.peers), q, gk, gv)
            if part is not None:
                parts.add(*part)
        else:
            for src, chunk in ring_chunks(kv, plan.group, layer):
                ck, cv = unpack_kv(chunk)
                part = partial(("ring", src), queries, plan.peers[src], q, ck, cv)
                if part is not None:
                    parts.add(*part)
        return tie(parts.result()[0] if parts.count else q * 0.0)

    n = plan.num_noisy
    noisy_rows, clean_rows = local.select(slice(0, n)), local.select(slice(n, None))
    # What the clean exchange moves: this rank's clean K and V, or their source rows alone.
    outgoing = None
    if plan.exchange == "clean":
        outgoing = pack_kv(k[n:], v[n:]) if kv_source is None else kv_source.raw[n:]

    def arrived(tag, rows: RowMeta, received: torch.Tensor):
        """K and V of rows received from other ring members."""
        if kv_source is None:
            return unpack_kv(received)
        return kv_source.derive(received, plan.positions(tag, rows, device))

    pending = windowed = None
    if plan.exchange == "clean" and geometry.window is not None:
        # Sliding-window layer: only the clean rows inside the windows move (one all-to-all).
        windowed = plan.window_exchange(geometry)
        pending = PendingAllToAll(outgoing, windowed.send_index, windowed.recv_counts, plan.group, layer)
    elif plan.exchange == "clean" and plan.transport == "allgather":
        # Start moving clean K/V now; the block-diagonal noisy attention below overlaps it.
        pending = PendingGather(outgoing, plan.group, layer)

    if not n:
        noisy_part = None
    elif plan.noisy_rows_are_whole_blocks:
        noisy_part = block_diagonal_attention(q[:n], k[:n], v[:n], geometry.block_size, kernel, softmax_scale,
                                              plan.block_diagonal_mask(device))
    else:
        noisy_part = partial(("noisy",), noisy_rows, noisy_rows, q[:n], k[:n], v[:n])

    clean_parts = PartialMerge()  # streamed: ring chunks merge as they arrive

    def add_clean(part):
        if part is not None:
            clean_parts.add(*part)

    if plan.exchange == "none":
        add_clean(partial(("clean",), queries, clean_rows, q, k[n:], v[n:]))
    elif windowed is not None:
        recv_rows = RowMeta.cat(windowed.recv_rows)
        # Derived even when nothing arrived: the empty result keeps the all-to-all's backward
        # (which this rank's sent rows need) in the graph.
        rk, rv = arrived(("window", geometry.window), recv_rows, pending.result())
        keys = RowMeta.cat([clean_rows, recv_rows])
        add_clean(partial(("window",), queries, keys, q, torch.cat([k[n:], rk]), torch.cat([v[n:], rv])))
    elif plan.transport == "allgather":
        if kv_source is None:
            gk, gv = unpack_kv(pending.result())
        else:
            # The own shard in the gathered rows is replaced by this rank's K and V.
            me, sizes = plan.ring_index, [len(p) for p in plan.peers]
            start, stop = sum(sizes[:me]), sum(sizes[: me + 1])
            gathered = pending.result()
            others = torch.cat([gathered[:start], gathered[stop:]])
            ok, ov = arrived(("gathered",), RowMeta.cat(plan.peers[:me] + plan.peers[me + 1 :]), others)
            gk = torch.cat([ok[:start], k[n:], ok[start:]])
            gv = torch.cat([ov[:start], v[n:], ov[start:]])
        add_clean(partial(("clean",), queries, RowMeta.cat(plan.peers), q, gk, gv))
    else:
        for src, chunk in ring_chunks(outgoing, plan.group, layer):
            if kv_source is not None and src == plan.ring_index:
                ck, cv = k[n:], v[n:]
            else:
                ck, cv = arrived(("ring", src), plan.peers[src], chunk)
            add_clean(partial(("ring", src), queries, plan.peers[src], q, ck, cv))
    if not clean_parts.count:
        # Only possible when no query sees a clean key (block 0 alone): noisy part is everything.
        # With no query rows at all (a DFlash rank that owns no block) the output is empty.
        return tie(noisy_part[0] if noisy_part is not None else q * 0.0)
    clean_out, clean_lse = clean_parts.result()
    if noisy_part is None:
        return tie(clean_out)
    # Noisy queries merge their in-block part with their clean-prefix part; clean queries have
    # only the clean part.
    noisy_out, _ = merge_partials([noisy_part, (clean_out[:n], clean_lse[..., :n])])
    return tie(torch.cat([noisy_out, clean_out[n:]], dim=0))


def block_diagonal_attention(q, k, v, block_size: int, kernel, softmax_scale: float,
                             mask: Optional[PartialMask] = None):
    """Bidirectional attention inside each block of B consecutive rows, blocks folded into the
    batch: nb dense B x B problems instead of one (nb*B)^2 masked one. `mask`: the all-allowed
    `PartialMask.block_diagonal(B)` (a plan passes its cached one, so kernels cache what they
    derive from it once)."""
    n, b, H, d = q.shape
    nb, B = n // block_size, block_size

    def fold(x):  # [nb*B, b, h, d] -> [B, nb*b, h, d]
        return x.reshape(nb, B, b, x.shape[2], d).transpose(0, 1).reshape(B, nb * b, x.shape[2], d)

    if mask is None:
        mask = PartialMask.block_diagonal(B, q.device)
    out, lse = kernel(fold(q), fold(k), fold(v), mask, softmax_scale)
    out = out.reshape(B, nb, b, H, d).transpose(0, 1).reshape(n, b, H, d)
    lse = lse.reshape(nb, b, H, B).permute(1, 2, 0, 3).reshape(b, H, n)
    return out, lse


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
    members = [layout.rows(r) for r in layout.ring_ranks(rank)]
    ring_index = layout.ring_of(rank)[1]
    if kind == "cp":
        return AttentionPlan(layout.geometry, local, "all", transport, group, members, members, ring_index)
    return AttentionPlan(layout.geometry, local, "clean", transport, group, layout.ring_clean_rows(rank), members,
                         ring_index)
