"""Exchange strategies: how one rank's core attention gets the keys its queries see.

One small class per exchange and transport, registered under (exchange, transport, sliding-window
layer) and chosen when the `AttentionPlan` is built; `AttentionCall` holds what they share.
Adding a strategy: one subclass of `ExchangeStrategy` (or `NoisyThenClean`) and one
`@register(...)` line. The table and the shared skeleton: docs/architecture.md#one-ranks-attention-attention.
"""
from __future__ import annotations

from itertools import product
from typing import TYPE_CHECKING, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_csbp.attention.merge import PartialMerge, merge_partials, merged
from megatron_csbp.attention.transports import (TRANSPORTS, PendingAllToAll, PendingGather, pack_kv, ring_chunks,
                                                unpack_kv)
from megatron_csbp.layout.masks import BlockGeometry, RowMeta
from megatron_csbp.layout.rows import PartialMask

if TYPE_CHECKING:  # pragma: no cover
    from megatron_csbp.attention.block_attention import AttentionPlan, KVSource

Partial = Tuple[torch.Tensor, torch.Tensor]  # (out [sq, b, H, d], lse [b, H, sq])


# --- how clean K/V travel ------------------------------------------------------------------------

class PackedKV:
    """Clean K and V travel as they are, packed [rows, b, 2G, d] (one collective per step)."""

    def outgoing(self, call: "AttentionCall") -> torch.Tensor:
        return pack_kv(call.k_clean, call.v_clean)

    def arrived(self, call: "AttentionCall", *args):
        """(k, v) of the received rows, the last argument of each of the three hooks."""
        return unpack_kv(args[-1])

    gathered = ring_chunk = arrived


class SourceKV:
    """Clean rows travel as their K/V source's raw rows; receivers derive K and V of the rows they
    got at their layout positions, and keep their own rows' K and V as given."""

    def __init__(self, source: "KVSource"):
        self.source = source

    def outgoing(self, call: "AttentionCall") -> torch.Tensor:
        return self.source.raw[call.n:]

    def arrived(self, call: "AttentionCall", tag: Tuple, rows: RowMeta, received: torch.Tensor):
        return self.source.derive(received, call.plan.positions(tag, rows, call.device))

    def gathered(self, call: "AttentionCall", gathered: torch.Tensor):
        # The own shard in the gathered rows is replaced by this rank's K and V.
        plan = call.plan
        me, sizes = plan.ring_index, [len(p) for p in plan.peers]
        start, stop = sum(sizes[:me]), sum(sizes[: me + 1])
        others = torch.cat([gathered[:start], gathered[stop:]])
        ok, ov = self.arrived(call, ("gathered",), RowMeta.cat(plan.peers[:me] + plan.peers[me + 1 :]), others)
        return torch.cat([ok[:start], call.k_clean, ok[start:]]), torch.cat([ov[:start], call.v_clean, ov[start:]])

    def ring_chunk(self, call: "AttentionCall", src: int, chunk: torch.Tensor):
        if src == call.plan.ring_index:
            return call.k_clean, call.v_clean
        return self.arrived(call, ("ring", src), call.plan.peers[src], chunk)


# --- what every strategy shares ------------------------------------------------------------------

def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` when it is all of its storage, else a compact copy of it (same values).

    Megatron's q, k and v are views of one fused QKV projection output ([rows, b, G, (H/G+2)*d]);
    RoPE gives q and k storages of their own, but v stays a view. A kernel that saves v for
    backward (the local partials of single, BP and CSBP's ring; CP and the all-gather paths save
    copies: packed, gathered or concatenated K/V) would keep the whole projection output alive
    until backward: (H/G+2)x v's bytes per layer instead of 1x, 4x in the benchmark model (H = 4,
    G = 2), which made CSBP's ring peak 1.04-1.07x CP's. The copy is v's own size."""
    if t.untyped_storage().nbytes() <= t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


class AttentionCall:
    """One core-attention call on this rank's local rows: q [sq, b, H, d], k/v [sq, b, G, d] in
    the plan's local order ([noisy ; clean]); the kernel, the masks and the merge."""

    def __init__(self, plan: "AttentionPlan", q, k, v, *, geometry: BlockGeometry, kernel, softmax_scale: float,
                 layer: int, kv_source: Optional["KVSource"] = None, own_kv: bool = True):
        # q is saved by every partial; k and v as given only by strategies that attend the local
        # rows in place (`ExchangeStrategy.saves_local_kv`; the others copy them first)
        q = own_storage(q)
        if own_kv:
            k, v = own_storage(k), own_storage(v)
        self.plan, self.q, self.k, self.v = plan, q, k, v
        self.geometry, self.kernel, self.softmax_scale, self.layer = geometry, kernel, softmax_scale, layer
        self.device = q.device
        self.n = plan.num_noisy
        local = plan.local
        self.noisy_rows, self.clean_rows = local.select(slice(0, self.n)), local.select(slice(self.n, None))
        # Query metadata: every local row, or the noisy rows alone when clean rows are keys only.
        self.queries = local if plan.clean_queries else self.noisy_rows
        self.kv = PackedKV() if kv_source is None else SourceKV(kv_source)
        # The noisy and clean rows of q, k, v as one split each, not two slices: a slice's
        # backward allocates a zero gradient of the whole tensor (two per tensor, then their sum);
        # a split's backward concatenates its parts once.
        (self.q_noisy, self.q_clean), (self.k_noisy, self.k_clean), (self.v_noisy, self.v_clean) = (
            x.split([self.n, x.shape[0] - self.n]) for x in (q, k, v))
        # Chunks that arrived over the network but have no allowed pair are skipped; they stay
        # tied to the output with a zero so that every rank runs the same backward collectives.
        self.anchors: List[torch.Tensor] = []

    def partial(self, tag: Tuple, q_rows: RowMeta, k_rows: RowMeta, q, k, v) -> Optional[Partial]:
        """The kernel on (q_rows, k_rows) under the plan's cached mask for `tag`, keys no query
        sees dropped first; None (and a zero tie) when no pair is allowed."""
        m, cols = self.plan.mask(tag, q_rows, k_rows, self.geometry, self.device)
        if m.shape[1] == 0:
            if k.requires_grad:
                self.anchors.append(k.sum() + v.sum())
            return None
        if cols is not None:
            k, v = k.index_select(0, cols), v.index_select(0, cols)
        return self.kernel(q, k, v, m, self.softmax_scale)

    def noisy_part(self) -> Optional[Partial]:
        """Noisy queries on their own block's keys: never moves; dense B x B batches when the
        noisy rows are whole blocks."""
        if not self.n:
            return None
        if self.plan.noisy_rows_are_whole_blocks:
            return block_diagonal_attention(self.q_noisy, self.k_noisy, self.v_noisy, self.geometry.block_size,
                                            self.kernel, self.softmax_scale, self.plan.block_diagonal_mask(self.device))
        return self.partial(("noisy",), self.noisy_rows, self.noisy_rows, self.q_noisy, self.k_noisy, self.v_noisy)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        for a in self.anchors:
            out = out + 0.0 * a
        return out

    def only(self, merge: PartialMerge) -> torch.Tensor:
        """The output when `merge` holds every key a query sees (zeros when it holds nothing)."""
        return self.finish(merge.result()[0] if merge.count else self.q * 0.0)

    def combine(self, noisy: Optional[Partial], clean: PartialMerge) -> torch.Tensor:
        """Noisy queries merge their in-block part with their clean-prefix part; clean queries
        have only the clean part."""
        if not clean.count:
            # Only possible when no query sees a clean key (block 0 alone): noisy part is everything.
            # With no query rows at all (a DFlash rank that owns no block) the output is empty.
            return self.finish(noisy[0] if noisy is not None else self.q * 0.0)
        clean_out, clean_lse = clean.result()
        if noisy is None:
            return self.finish(clean_out)
        n = self.n
        out_noisy, out_clean = clean_out.split([n, clean_out.shape[0] - n])
        noisy_out, _ = merge_partials([noisy, (out_noisy, clean_lse[..., :n])])
        return self.finish(torch.cat([noisy_out, out_clean], dim=0))


# --- the registry --------------------------------------------------------------------------------

class ExchangeStrategy:
    """How a rank gets the keys its queries see, and attends them: `attend(call) -> out`."""

    name = "?"
    #: whether the strategy moves a `KVSource`'s raw rows when the layer offers one
    moves_kv_source = False
    #: whether a kernel is handed the call's own k and v (not a copy): they must not be views of a
    #: larger storage then (`own_storage`)
    saves_local_kv = False

    def attend(self, call: AttentionCall) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"


_STRATEGIES: Dict[Tuple[str, str, bool], ExchangeStrategy] = {}


def register(exchange: str, transports: Iterable[str] = TRANSPORTS, windowed: Iterable[bool] = (False, True)):
    """Class decorator: one instance of the strategy serves `exchange` over each of `transports`
    on the layer kinds in `windowed` (False: full-attention layers, True: sliding-window layers)."""

    def add(cls):
        instance = cls()
        for key in product([exchange], transports, windowed):
            if key in _STRATEGIES:
                raise ValueError(f"{key} already served by {_STRATEGIES[key]!r}")
            _STRATEGIES[key] = instance
        return cls

    return add


def select_strategy(exchange: str, transport: str, windowed: bool) -> ExchangeStrategy:
    """The registered strategy of `exchange` over `transport` on a (sliding-window) layer."""
    try:
        return _STRATEGIES[(exchange, transport, bool(windowed))]
    except KeyError:
        raise ValueError(f"no attention strategy for exchange {exchange!r} over transport {transport!r}: "
                         f"--attention-transport must be one of {TRANSPORTS}") from None


# --- single, BP and CSBP: noisy blocks local, clean keys local or exchanged ------------------------

class NoisyThenClean(ExchangeStrategy):
    """Local rows are [noisy ; clean]. The transport starts first (`start`), the block-diagonal
    noisy attention overlaps it, then the clean partials (`clean_parts`) merge as they arrive.

    A kernel that takes a rank's local rows in one partial without loss (`one_local_partial`:
    whole noisy blocks and clean prefixes are pieces of its own plan) gets the local noisy keys
    in the partial that holds the local clean keys (`with_noisy`): no separate noisy output, no
    noisy/clean merge and concatenation, so CSBP keeps no more per layer than one partial per
    key set, as CP does."""

    def start(self, call: AttentionCall):
        return None

    def clean_parts(self, call: AttentionCall, pending, with_noisy: bool = False) -> Iterator[Optional[Partial]]:
        raise NotImplementedError

    def attend(self, call: AttentionCall) -> torch.Tensor:
        pending = self.start(call)
        if getattr(call.kernel, "one_local_partial", False):
            return call.only(merged(self.clean_parts(call, pending, with_noisy=True)))
        noisy = call.noisy_part()
        return call.combine(noisy, merged(self.clean_parts(call, pending)))


@register("none")
class NoExchange(NoisyThenClean):
    """Single rank and BP: every clean key a query sees is on this rank."""

    name = "none"
    saves_local_kv = True

    def clean_parts(self, call, pending, with_noisy=False):
        if with_noisy:
            yield call.partial(("local",), call.queries, call.plan.local, call.q, call.k, call.v)
        else:
            yield call.partial(("clean",), call.queries, call.clean_rows, call.q, call.k_clean, call.v_clean)


@register("clean", ["allgather"], [False])
class CleanAllGather(NoisyThenClean):
    """CSBP: every ring member's clean rows, all-gathered while the noisy part runs."""

    name = "clean all-gather"
    moves_kv_source = True

    def start(self, call):
        return PendingGather(call.kv.outgoing(call), call.plan.group, call.layer)

    def clean_parts(self, call, pending, with_noisy=False):
        gk, gv = call.kv.gathered(call, pending.result())
        # the gathered clean rows in position order (`plan.gathered_runs`): every clean prefix one run of keys
        runs = call.plan.gathered_runs()
        rows = RowMeta.cat(call.plan.peers)
        rows = RowMeta.cat([rows.select(r) for r in runs])
        tag, ks, vs = ("clean",), [gk[r] for r in runs], [gv[r] for r in runs]
        if with_noisy:  # [local noisy ; gathered clean]: one partial (the copy replaces the gathered rows)
            tag, rows = ("noisy+gathered",), RowMeta.cat([call.noisy_rows, rows])
            ks, vs = [call.k_noisy] + ks, [call.v_noisy] + vs
        yield call.partial(tag, call.queries, rows, call.q, torch.cat(ks), torch.cat(vs))


@register("clean", ["ring"], [False])
class CleanRing(NoisyThenClean):
    """CSBP: the clean shards stream around the ring, each attended as it arrives."""

    name = "clean ring"
    moves_kv_source = True
    saves_local_kv = True

    def clean_parts(self, call, pending, with_noisy=False):
        plan = call.plan
        for src, chunk in ring_chunks(call.kv.outgoing(call), plan.group, call.layer):
            if with_noisy and src == plan.ring_index:  # the own chunk with the local noisy rows: all local rows
                yield call.partial(("local",), call.queries, plan.local, call.q, call.k, call.v)
                continue
            ck, cv = call.kv.ring_chunk(call, src, chunk)
            yield call.partial(("ring", src), call.queries, plan.peers[src], call.q, ck, cv)


@register("clean", windowed=[True])
class CleanWindowed(NoisyThenClean):
    """CSBP on a sliding-window layer (either transport): only the clean rows inside some local
    query's window move, by one all-to-all (`layout.exchange.WindowExchangePlan`)."""

    name = "clean windowed"
    moves_kv_source = True

    def start(self, call):
        windowed = call.plan.window_exchange(call.geometry)
        return windowed, PendingAllToAll(call.kv.outgoing(call), windowed.send_index, windowed.recv_counts,
                                         call.plan.group, call.layer)

    def clean_parts(self, call, pending, with_noisy=False):
        windowed, transfer = pending
        recv_rows = RowMeta.cat(windowed.recv_rows)
        # Derived even when nothing arrived: the empty result keeps the all-to-all's backward
        # (which this rank's sent rows need) in the graph.
        rk, rv = call.kv.arrived(call, ("window", call.geometry.window), recv_rows, transfer.result())
        if with_noisy:  # [all local rows ; received]
            tag, rows, k, v = ("window+local",), call.plan.local, call.k, call.v
        else:
            tag, rows, k, v = ("window",), call.clean_rows, call.k_clean, call.v_clean
        yield call.partial(tag, call.queries, RowMeta.cat([rows, recv_rows]), call.q, torch.cat([k, rk]),
                           torch.cat([v, rv]))


# --- the CP baseline: K/V of every row cross ranks -----------------------------------------------

# K/V of all local rows are exchanged (packed; never a K/V source, as Megatron's CP has none) and
# every query attends every chunk under the same predicate.

@register("all", ["allgather"])
class FullAllGather(ExchangeStrategy):
    name = "full all-gather"

    def attend(self, call):
        gk, gv = unpack_kv(PendingGather(pack_kv(call.k, call.v), call.plan.group, call.layer).result())
        return call.only(merged([call.partial(("all",), call.queries, RowMeta.cat(call.plan.peers), call.q, gk, gv)]))


@register("all", ["ring"])
class FullRing(ExchangeStrategy):
    name = "full ring"

    def attend(self, call):
        plan = call.plan
        chunks = ring_chunks(pack_kv(call.k, call.v), plan.group, call.layer)
        # a generator: each chunk is merged as it arrives
        return call.only(merged(call.partial(("ring", src), call.queries, plan.peers[src], call.q, *unpack_kv(chunk))
                                for src, chunk in chunks))


def block_diagonal_attention(q, k, v, block_size: int, kernel, softmax_scale: float, mask: PartialMask):
    """Bidirectional attention inside each block of B consecutive rows, blocks folded into the
    batch: nb dense B x B problems instead of one (nb*B)^2 masked one. `mask`: the all-allowed
    `PartialMask.block_diagonal(B)` (a plan passes its cached one, so kernels cache what they
    derive from it once)."""
    n, b, H, d = q.shape
    nb, B = n // block_size, block_size

    def fold(x):  # [nb*B, b, h, d] -> [B, nb*b, h, d]
        return x.reshape(nb, B, b, x.shape[2], d).transpose(0, 1).reshape(B, nb * b, x.shape[2], d)

    out, lse = kernel(fold(q), fold(k), fold(v), mask, softmax_scale)
    return (out.reshape(B, nb, b, H, d).transpose(0, 1).reshape(n, b, H, d),
            lse.reshape(nb, b, H, B).permute(1, 2, 0, 3).reshape(b, H, n))
