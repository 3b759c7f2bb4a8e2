"""Gated DeltaNet (GDN) linear-attention layers in a block diffusion LM, on any layout.

A noisy block continues from the clean stream's recurrent state (and conv tail) at its start; the
chunked rule (`chunk_rule`) runs one chunk per block; under layouts clean runs get their start
states from all-gathered affine transfer maps and boundary states go to block owners by one
all-to-all. Semantics, the rule and the distribution:
docs/semantics.md#gated-deltanet-layers-attentiongated_deltapy-modelhybridpy.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn.functional as F

from megatron.core.ssm.gated_delta_net import GatedDeltaNet, torch_chunk_gated_delta_rule

from megatron_csbp.attention.transports import PendingAllToAll, PendingGather
from megatron_csbp.layout.rows import index_runs
from megatron_csbp.utils.precision import compute_dtype

#: The module whose globals megatron-core's GatedDeltaNet constructor reads (its FLA import guard
#: `HAVE_FLA`, its `torch`): in 0.16.1 the module `megatron.core.ssm.gated_delta_net`; from 0.19 that
#: name is a package and the constructor is `_GDNBase.__init__` in its `common` module.
_mc_gdn = importlib.import_module(GatedDeltaNet.__init__.__module__)

L2NORM_EPS = 1e-6  # flash-linear-attention's l2norm (and transformers' copy of it)


# ---- the rule ------------------------------------------------------------------------------------

def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_rule(q, k, v, g, beta, state):
    """One chunk of the gated delta rule from `state`. q, k [N, H, T, d_k] (q already scaled),
    v [N, H, T, d_v], g (log decay) and beta [N, H, T], state [N, H, d_k, d_v].
    Returns (o [N, H, T, d_v], state after the chunk)."""
    T = q.shape[-2]
    G = g.cumsum(-1)
    tri = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    strict = tri.clone().fill_diagonal_(False)
    # exp only where s <= t: the masked-out entries would overflow
    D = torch.where(tri, G[..., :, None] - G[..., None, :], torch.full_like(G[..., :1, None], float("-inf"))).exp()
    A = torch.where(strict, beta[..., :, None] * D * (k @ k.transpose(-1, -2)), torch.zeros((), dtype=q.dtype))
    gam = G.exp()
    rhs = beta[..., None] * v - (beta * gam)[..., None] * (k @ state)
    eye = torch.eye(T, dtype=q.dtype, device=q.device)
    U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    out = gam[..., None] * (q @ state) + (D * (q @ k.transpose(-1, -2))) @ U
    new_state = gam[..., -1, None, None] * state + (k * D[..., -1, :, None]).transpose(-1, -2) @ U
    return out, new_state


def recurrent_rule(q, k, v, g, beta, state):
    """The same rule token by token (the tests' reference). Shapes as `chunk_rule`."""
    outs = []
    for t in range(q.shape[-2]):
        state = state * g[..., t, None, None].exp()
        u = beta[..., t, None] * (v[..., t, :] - (state * k[..., t, :, None]).sum(-2))
        state = state + k[..., t, :, None] * u[..., None, :]
        outs.append((state * q[..., t, :, None]).sum(-2))
    return torch.stack(outs, dim=-2), state


# ---- static routing --------------------------------------------------------------------------------

def _runs(positions: torch.Tensor) -> List[Tuple[int, int]]:
    """[(start, end)) runs of consecutive values of a sorted position list."""
    return [(s.start, s.stop) for s in index_runs(positions)]


def _rows_by_position(rows, select: torch.Tensor) -> torch.Tensor:
    """Indices of the rows where `select` holds, in position order."""
    idx = torch.nonzero(select).flatten()
    return idx[torch.argsort(rows.position[idx])]


def _segment_chunks(feats, state, s: int, e: int, B: int):
    """`chunk_rule` over the features (q, k, v, g, beta) of positions [s, e), one chunk per block
    piece: yields (chunk end, chunk output, state after the chunk)."""
    cuts = [s] + list(range((s // B + 1) * B, e, B)) + [e]
    for c0, c1 in zip(cuts[:-1], cuts[1:]):
        o, state = chunk_rule(*(x[:, :, c0 - s:c1 - s] for x in feats), state)
        yield c1, o, state


@dataclass
class GDNRoutes:
    """Static placement of one rank's GDN work under a plan (same on every rank of the ring)."""

    noisy_rows: torch.Tensor  # [nb, B] local row indices of each local noisy block, position order
    noisy_blocks: List[int]
    clean_rows: torch.Tensor  # local row indices of the clean rows in position order
    segments: List[Tuple[int, int]]  # this rank's clean runs [start, end)
    ring: int  # ring size (1: every needed clean row is local)
    ring_index: int
    max_segments: int
    member_segments: List[List[Tuple[int, int]]]  # every ring member's runs
    # boundary routing: blocks this rank sends (per destination, in the receiver's order) and receives
    send_blocks: List[List[int]]
    recv_blocks: List[List[int]]  # per source: my noisy blocks whose boundary it sends
    # whether any member of the ring sends a boundary (the same on every member, so either all of
    # them join the all-to-all or none does)
    ring_sends: bool


def build_routes(plan, conv_kernel: int) -> GDNRoutes:
    rows = plan.local
    B = plan.geometry.block_size
    noisy_idx = _rows_by_position(rows, ~rows.is_clean)
    npos = rows.position[noisy_idx]
    blocks = npos.view(-1, B) if len(npos) % B == 0 else None  # [nb, B] positions
    if blocks is None or not bool(((blocks[:, :1] % B == 0) & (blocks - blocks[:, :1] == torch.arange(B))).all()):
        raise ValueError("Gated DeltaNet layers need whole noisy blocks on every rank: under the CP baseline choose "
                         "--seq-length / --context-parallel-size as a multiple of --block-size")
    noisy_blocks = (blocks[:, 0] // B).tolist()
    clean_idx = _rows_by_position(rows, rows.is_clean)
    segments = _runs(rows.position[clean_idx])
    if plan.exchange == "none":
        ring, ring_index, members = 1, 0, [segments]
    else:
        ring, ring_index = len(plan.members), plan.ring_index
        members = [_runs(torch.sort(m.position[m.is_clean]).values) for m in plan.members]
    # The clean stream of the ring must tile [0, end) (each position held once).
    flat = sorted(s for m in members for s in m)
    for (s, _), cursor in zip(flat, [0] + [e for _, e in flat]):
        if s != cursor:
            raise ValueError(f"Gated DeltaNet: the clean rows of the ring do not tile a prefix (gap or overlap at {cursor})")
    if ring > 1:
        short = [s for m in members for s in m if s[1] - s[0] < conv_kernel - 1]
        if short:
            raise ValueError(f"Gated DeltaNet: clean shard pieces {short} are shorter than linear_conv_kernel_dim - 1 "
                             f"= {conv_kernel - 1} rows; use a longer --seq-length per rank")
    send_blocks, recv_blocks = [[] for _ in range(ring)], [[] for _ in range(ring)]
    ring_sends = False
    for dest, m in enumerate(plan.members if ring > 1 else [rows]):
        for b in sorted(set((m.position[~m.is_clean] // B).tolist())):
            if b == 0:  # starts from the zero state: nothing to send
                continue
            # the ring index whose clean runs hold the block's last clean position (None: nobody's)
            src = next((i for i, m in enumerate(members) if any(s < b * B <= e for s, e in m)), None)
            if src is None:
                raise ValueError(f"Gated DeltaNet: no rank of the ring holds clean position {b * B - 1}")
            ring_sends = ring_sends or src != dest
            if src == ring_index and dest != ring_index:
                send_blocks[dest].append(b)
            elif dest == ring_index and src != ring_index:
                recv_blocks[src].append(b)
    return GDNRoutes(noisy_idx.view(-1, B), noisy_blocks, clean_idx, segments, ring, ring_index,
                     max(len(m) for m in members), members, send_blocks, recv_blocks, ring_sends)


# ---- the layer --------------------------------------------------------------------------------------

class BlockDiffusionGatedDeltaNet(GatedDeltaNet):
    """megatron-core's `GatedDeltaNet` (same parameters, same checkpoint layout, TP included) whose
    forward follows the block-diffusion plan passed as `attention_mask` (docs/semantics.md).

    The forward is this module's own (pure torch, float64-capable), so flash-linear-attention is
    not needed: its absence only lifts megatron-core's import guard while building."""

    def __init__(self, *args, cp_comm_type=None, **kwargs):
        # cp_comm_type: Megatron passes it to every attention module when its CP size > 1; the
        # block layout, not Megatron's CP, decides what this layer exchanges.
        from megatron_csbp.compat.device import torch_view_for_module

        saved = _mc_gdn.HAVE_FLA, _mc_gdn.torch
        _mc_gdn.HAVE_FLA = True  # the guard only; nothing of FLA is used here
        _mc_gdn.torch = torch_view_for_module()  # conv1d / A_log / dt_bias on torch.cuda.current_device()
        try:
            super().__init__(*args, **kwargs)
        finally:
            _mc_gdn.HAVE_FLA, _mc_gdn.torch = saved
        self.layer_number = self.layer_number or 1
        # out_norm sees only this TP rank's value heads: its weight gradient is a partial sum over
        # TP, reduced in backward by `_gated_norm` itself (also under sequence parallelism, where the
        # rows are already gathered), so it must not be reduced again as a sequence-parallel norm.
        for p in self.out_norm.parameters():
            p.sequence_parallel = False

    def _setup_variant_attrs(self):
        """megatron-core 0.19's sizing hook (its constructor calls it; 0.16.1 has none), which also
        picks the kernel of megatron's own forward and asserts it is not None: without FLA its
        chunked kernel is None. This module's forward runs `chunk_rule`, never that kernel, so the
        slot gets megatron-core's torch kernel (what its deterministic mode uses) instead."""
        super()._setup_variant_attrs()
        if self.gated_delta_rule is None:
            self.gated_delta_rule = torch_chunk_gated_delta_rule

    def reset_parameters(self):
        """megatron's initialisation (dt_bias = 1, A = U(A_init_range), conv uniform when conv_init),
        drawn inside the model-parallel RNG stream when one is set up, else the default generator."""
        if not self.config.perform_initialization:
            return
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        ctx = tracker.fork() if tracker.get_states() else contextlib.nullcontext()
        with ctx, torch.no_grad():
            if self.conv_init is not None:
                torch.nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
            self.dt_bias.fill_(1.0)
            A = torch.empty_like(self.A_log).uniform_(*self.A_init_range)
            self.A_log.copy_(torch.log(A))

    # -- pieces on [N, T, ...] tensors ------------------------------------------------------------
    def _zero_state(self, b: int, dtype, device) -> torch.Tensor:
        """The zero recurrent state [b, H, d_k, d_v] of this TP rank's value heads."""
        heads = self.num_value_heads // self.tp_size
        return torch.zeros(b, heads, self.key_head_dim, self.value_head_dim, dtype=dtype, device=device)

    def _conv(self, x_with_halo: torch.Tensor) -> torch.Tensor:
        """x [N, K-1+T, conv] (halo first) -> activated conv output [N, T, conv]."""
        w = self.conv1d.weight
        y = F.conv1d(x_with_halo.transpose(1, 2), w.to(x_with_halo.dtype),
                     None if self.conv1d.bias is None else self.conv1d.bias.to(x_with_halo.dtype),
                     groups=w.shape[0])
        return self.act_fn(y).transpose(1, 2)

    def _features(self, conv_out, beta_raw, alpha, dtype):
        """conv output [N, T, conv], beta/alpha [N, T, Hv] -> q, k, v [N, H, T, d], g, beta [N, H, T]."""
        tp = self.tp_size
        dims = (self.key_head_dim, self.key_head_dim, self.value_head_dim)
        q, k, v = (x.unflatten(-1, (-1, dim)).to(dtype) for x, dim in
                   zip(torch.split(conv_out, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1), dims))
        if self.use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        rep = self.num_value_heads // self.num_key_heads
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        q = q * (self.key_head_dim ** -0.5)
        g = -self.A_log.to(dtype).exp() * F.softplus(alpha.to(dtype) + self.dt_bias.to(dtype))
        beta = beta_raw.to(dtype).sigmoid()
        return tuple(x.transpose(1, 2) for x in (q, k, v, g, beta))

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None, **kwargs):
        from megatron_csbp.attention.plan_handles import plan_from_mask

        if inference_context is not None or inference_params is not None:
            raise ValueError("Gated DeltaNet block-diffusion layers do not support inference contexts")
        if packed_seq_params is not None:
            raise ValueError("packed sequences (THD) are not supported with block diffusion; pack to --seq-length")
        plan = plan_from_mask(attention_mask)
        K = self.conv_kernel_dim
        routes = plan.cached(("gdn_routes", K), lambda: build_routes(plan, K))
        qkvzba, _ = self.in_proj(hidden_states)  # [rows, b, in_proj / TP] (sequence-parallel: gathered)
        if qkvzba.shape[0] != len(plan.local):
            raise RuntimeError(f"Gated DeltaNet got {qkvzba.shape[0]} rows, the block layout has {len(plan.local)}")
        if plan.physical_order is not None:
            qkvzba = qkvzba.index_select(0, torch.argsort(plan.physical_order).to(qkvzba.device))
        tp = self.tp_size
        qkvzba = qkvzba.transpose(0, 1)  # [b, rows, .]
        mixed, gate, beta_raw, alpha = torch.split(
            qkvzba, [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp,
                     self.num_value_heads // tp, self.num_value_heads // tp], dim=-1)
        b, S, _ = mixed.shape
        dtype = compute_dtype(mixed.dtype)
        core = mixed.new_zeros(b, S, self.num_value_heads // tp, self.value_head_dim, dtype=dtype)
        # Collectives of the layer, in order; each one's input is tied to the previous ones' outputs so
        # that backward runs them in reverse order on every rank, whatever rows a rank holds.
        ties = []
        clean_out, boundaries = self._clean_stream(mixed, beta_raw, alpha, routes, plan, dtype, ties)
        if clean_out is not None:
            core = core.index_copy(1, routes.clean_rows.to(core.device), clean_out)
        # every ring member joins the boundary exchange, also one without noisy rows (CP baseline)
        received = self._route_boundaries(routes, plan, boundaries, b, mixed.shape[2], mixed, dtype, ties)
        if len(routes.noisy_blocks):
            noisy_out = self._noisy_blocks(mixed, beta_raw, alpha, routes, boundaries, received, dtype)
            core = core.index_copy(1, routes.noisy_rows.flatten().to(core.device), noisy_out)
        # A rank may receive no boundary (or need no halo): the collectives' outputs still reach
        # the loss, so that every rank runs their backward (the other ranks wait for it).
        core = _tied(core, ties)
        out = self._gated_norm(core.to(mixed.dtype), gate)  # [b*rows, d_v]
        out = out.reshape(b, S, -1).transpose(0, 1)
        if plan.physical_order is not None:
            out = out.index_select(0, plan.physical_order.to(out.device))
        return self.out_proj(out.contiguous())

    def _gated_norm(self, x, gate):
        """out_norm(x) * act(gate), the gate in at least fp32 (Megatron's `_apply_gated_norm`
        without its jit and its fp32 cast, so float64 stays float64)."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        x = x.reshape(-1, x.shape[-1])
        weight = self.out_norm.weight
        if self.tp_size > 1:  # identity forward; backward sums the weight gradient over TP
            weight = copy_to_tensor_model_parallel_region(weight, group=self.pg_collection.tp)
        y = F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps=self.config.layernorm_epsilon)
        gate = gate.reshape(-1, x.shape[-1])
        return (y * self.act_fn(gate.to(compute_dtype(gate.dtype)))).to(x.dtype)

    # -- clean stream ---------------------------------------------------------------------------------
    def _clean_stream(self, mixed, beta_raw, alpha, routes: GDNRoutes, plan, dtype, ties):
        """Outputs of the clean rows ([b, clean, Hv, d_v] in position order) and the boundary payload
        of every block start this rank holds: {block: (state [b, H, d_k, d_v], halo [b, K-1, conv])}."""
        K, B = self.conv_kernel_dim, plan.geometry.block_size
        if not routes.segments:
            return None, {}
        idx = routes.clean_rows.to(mixed.device)
        lengths = [e - s for s, e in routes.segments]
        pieces, betas, alphas = (list(torch.split(x.index_select(1, idx), lengths, dim=1))
                                 for x in (mixed, beta_raw, alpha))
        # each segment's pre-conv rows s-K+1 .. e-1
        halos = self._halos(pieces, routes, plan, ties)
        exts = [torch.cat([halo, piece], dim=1) for halo, piece in zip(halos, pieces)]
        feats = [self._features(self._conv(ext), cbeta, calpha, dtype)
                 for ext, cbeta, calpha in zip(exts, betas, alphas)]
        zero = self._zero_state(len(mixed), dtype, mixed.device)
        starts = self._segment_start_states(feats, routes, plan, zero, ties)
        outs, boundaries = [], {}
        for (s, e), feat, state, ext in zip(routes.segments, feats, starts, exts):
            for c1, o, state in _segment_chunks(feat, state, s, e, B):
                outs.append(o)
                if c1 % B == 0:  # state at block start c1; the K-1 pre-conv rows before it
                    boundaries[c1 // B] = (state, ext[:, c1 - s:c1 - s + K - 1])
        out = torch.cat(outs, dim=2).transpose(1, 2)  # [b, clean, H, dv]
        return out, boundaries

    def _halos(self, pieces, routes: GDNRoutes, plan, ties):
        """The K-1 pre-conv rows before each local segment ([b, K-1, conv]; zeros before position 0)."""
        K = self.conv_kernel_dim
        zero = pieces[0].new_zeros(pieces[0].shape[0], K - 1, pieces[0].shape[2])  # [b, K-1, conv]
        if routes.ring == 1:  # one clean prefix from 0 (`_segment_start_states` refuses anything else)
            return [zero] * len(routes.segments)
        # all-gather every member's segment tails
        tails = [p[:, p.shape[1] - (K - 1):] for p in pieces]
        by_end = {e: tail for (_, e), tail in _gathered_segments(tails, routes, plan, self.layer_number, ties)}
        return [zero if s == 0 else by_end[s] for s, _ in routes.segments]

    def _segment_start_states(self, feats, routes: GDNRoutes, plan, zero, ties):
        if routes.ring == 1:
            if routes.segments[0][0] != 0 or len(routes.segments) != 1:
                raise ValueError("Gated DeltaNet: a rank without a clean ring must hold a clean prefix from 0")
            return [zero]
        B, dk = plan.geometry.block_size, self.key_head_dim
        eye = torch.eye(dk, dtype=zero.dtype, device=zero.device).expand(*zero.shape[:-1], dk)
        maps = []
        for (s, e), (q, k, v, g, beta) in zip(routes.segments, feats):
            vv = torch.cat([torch.zeros_like(v[..., :1]).expand(*v.shape[:-1], dk), v], dim=-1)
            *_, (_, _, state) = _segment_chunks((q, k, vv, g, beta), torch.cat([eye, zero], dim=-1), s, e, B)
            maps.append(state)  # [b, H, dk, dk + dv] = [M | N]
        gathered = _gathered_segments(maps, routes, plan, self.layer_number, ties)
        by_start = {s: (e, mn) for (s, e), mn in gathered}
        starts, state, p = {0: zero}, zero, 0
        while p in by_start:
            e, mn = by_start[p]
            state = mn[..., :dk] @ state + mn[..., dk:]  # S_end = M S_start + N
            p = e
            starts[p] = state
        return [starts[s] for s, _ in routes.segments]

    # -- noisy blocks --------------------------------------------------------------------------------------
    def _noisy_blocks(self, mixed, beta_raw, alpha, routes: GDNRoutes, boundaries, received, dtype):
        b, _, conv = mixed.shape
        zero = self._zero_state(b, dtype, mixed.device), mixed.new_zeros(b, self.conv_kernel_dim - 1, conv)
        starts = [zero if blk == 0 else received.get(blk) or boundaries[blk] for blk in routes.noisy_blocks]
        nb, Bsz = routes.noisy_rows.shape
        idx = routes.noisy_rows.flatten().to(mixed.device)
        fold = lambda x: x.index_select(1, idx).reshape(b, nb, Bsz, -1).transpose(0, 1).reshape(nb * b, Bsz, -1)
        x = torch.cat([torch.cat([halo.to(mixed.dtype) for _, halo in starts]), fold(mixed)], dim=1)
        q, k, v, g, beta = self._features(self._conv(x), fold(beta_raw), fold(alpha), dtype)
        o, _ = chunk_rule(q, k, v, g, beta, torch.cat([state for state, _ in starts]))  # [nb*b, H, B, dv]
        return o.unflatten(0, (nb, b)).permute(1, 0, 3, 2, 4).flatten(1, 2)  # [b, nb*B, H, dv]

    def _route_boundaries(self, routes: GDNRoutes, plan, boundaries, b, conv, mixed, dtype, ties):
        """All-to-all of the boundary payloads over the ring -> {block: (state, halo)} received."""
        if routes.ring == 1 or not routes.ring_sends:
            return {}
        H = self.num_value_heads // self.tp_size
        dk, dv = self.key_head_dim, self.value_head_dim
        K = self.conv_kernel_dim
        width = H * dk * dv + (K - 1) * conv
        order = [blk for dest in routes.send_blocks for blk in dest]
        payload = torch.zeros(0, b, width, dtype=dtype, device=mixed.device)
        if order:
            payload = torch.stack([torch.cat([x.reshape(b, -1).to(dtype) for x in boundaries[blk]], dim=-1)
                                   for blk in order], 0)
        send_index = list(torch.arange(len(order)).split([len(dest) for dest in routes.send_blocks]))
        recv_counts = [len(r) for r in routes.recv_blocks]
        got = PendingAllToAll(_tied(payload, ties), send_index, recv_counts, plan.group, self.layer_number).result()
        ties.append(got)
        received = [blk for src in routes.recv_blocks for blk in src]
        return {blk: (flat[:, :H * dk * dv].reshape(b, H, dk, dv), flat[:, H * dk * dv:].reshape(b, K - 1, conv))
                for blk, flat in zip(received, got)}


def _tied(local: torch.Tensor, ties: List[torch.Tensor]) -> torch.Tensor:
    """`local` + 0 x (the earlier collectives' outputs): the same values, and a graph edge that
    makes autograd finish this collective's backward before theirs on every rank."""
    for t in ties:
        local = local + 0.0 * t.sum().to(local.dtype)
    return local


def _gathered_segments(entries: List[torch.Tensor], routes: GDNRoutes, plan, layer: int, ties):
    """All-gather `entries` (one per local segment, padded with zeros to max_segments) over the
    ring: [((start, end), entry)] of every member's segments."""
    local = torch.stack(entries + [torch.zeros_like(entries[0])] * (routes.max_segments - len(entries)))
    gathered = PendingGather(_tied(local, ties), plan.group, layer).result()
    ties.append(gathered)
    return [(seg, gathered[i * routes.max_segments + j])
            for i, segs in enumerate(routes.member_segments) for j, seg in enumerate(segs)]
