"""A tiled, block-sparse partial attention for any device: memory linear in the rows, work
following the mask's allowed pairs.

Online softmax over occupied tiles only (full tiles unmasked), with a backward that recomputes
scores per chunk and gives lse its own gradient. Design and sizes:
docs/attention-kernels.md#tiled-attentiontiledpy-any-device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from megatron_csbp.layout.rows import PartialMask
from megatron_csbp.utils.precision import compute_dtype

# Masked scores are set to a large finite negative number rather than -inf: a query with no
# allowed key in one partial then gets a finite lse that the merge weights by exactly 0, and no
# NaN can appear in forward or backward. Shared by every kernel (re-exported by `kernels`).
MASKED_SCORE = -1.0e30

# CPU: 256 x 256 tiles keep a [b, H, 256, 2048] score chunk in a few MiB (cache-friendly
# matmuls) while the per-chunk Python overhead stays small against the arithmetic.
DEFAULT_Q_TILE = 256
DEFAULT_K_TILE = 256
MAX_RUN_KEYS = 2048


@dataclass(frozen=True)
class TileSchedule:
    """Per query tile, the key chunks to compute: (k0, k1, masked)."""

    q_tile: int
    k_tile: int
    runs: Tuple[Tuple[Tuple[int, int, bool], ...], ...]
    computed_pairs: int  # query x key pairs the chunks cover (>= the mask's allowed pairs)

    @property
    def chunks(self) -> int:
        return sum(len(r) for r in self.runs)

    @property
    def nbytes(self) -> int:
        return 3 * 8 * self.chunks  # three integers per chunk


def tile_schedule(mask: PartialMask, q_tile: int = DEFAULT_Q_TILE, k_tile: int = DEFAULT_K_TILE,
                  max_run_keys: int = MAX_RUN_KEYS) -> TileSchedule:
    """The chunks of occupied tiles of `mask`, cached on the mask."""

    def build() -> TileSchedule:
        nq, nk = mask.shape
        table = mask.tiles(q_tile, k_tile)
        occupied, full = table.occupied.cpu(), table.full.cpu()
        max_tiles = max(1, max_run_keys // k_tile)
        runs: List[Tuple[Tuple[int, int, bool], ...]] = []
        computed = 0
        for i in range(occupied.shape[0]):
            tq = min(nq, (i + 1) * q_tile) - i * q_tile
            tiles: List[List[int]] = []  # [first, last + 1) tile of each chunk
            is_full = full[i].tolist()
            for j in occupied[i].nonzero().flatten().tolist() if tq > 0 and nk > 0 else []:
                first, end = tiles[-1] if tiles else (None, None)
                if j == end and is_full[j] == is_full[first] and j - first < max_tiles:
                    tiles[-1][1] = j + 1
                else:
                    tiles.append([j, j + 1])
            row = tuple((a * k_tile, min(nk, b * k_tile), not is_full[a]) for a, b in tiles)
            computed += sum(tq * (k1 - k0) for k0, k1, _ in row)
            runs.append(row)
        return TileSchedule(q_tile, k_tile, tuple(runs), computed)

    return mask.derived(("tile_schedule", q_tile, k_tile, max_run_keys), build)


def heads_first(cdt, *xs):
    """[s, b, heads, d] tensors as contiguous [b, heads, s, d] in `cdt`."""
    return tuple(x.to(cdt).permute(1, 2, 0, 3).contiguous() for x in xs)


def _by_group(G: int, x: torch.Tensor) -> torch.Tensor:
    """[b, H, rows, ...] -> [b, G, H / G, rows, ...] (a view)."""
    return x.view(x.shape[0], G, -1, *x.shape[2:])


def _query_tiles(sched: TileSchedule, qg):
    """(q0, q1, the tile's queries [b, G, rep * tq, d], its chunks) of every query tile with chunks."""
    b, G, rep, sq, d = qg.shape
    for i, runs in enumerate(sched.runs):
        if runs:
            q0, q1 = i * sched.q_tile, min(sq, (i + 1) * sched.q_tile)
            yield q0, q1, qg[:, :, :, q0:q1].reshape(b, G, rep * (q1 - q0), d), runs


def _forward(q, kg, vg, mask: PartialMask, sched: TileSchedule, scale: float):
    """q [b, H, sq, d], k/v [b, G, sk, d] -> (out [b, H, sq, d], lse [b, H, sq])."""
    qg = _by_group(kg.shape[1], q)
    b, G, rep, sq, d = qg.shape
    out = torch.zeros_like(qg)
    lse = torch.full((b, G, rep, sq), MASKED_SCORE, dtype=qg.dtype, device=qg.device)
    for q0, q1, qi, runs in _query_tiles(sched, qg):
        tq = q1 - q0
        m = torch.full((b, G, rep, tq), MASKED_SCORE, dtype=qg.dtype, device=qg.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(b, G, rep, tq, d, dtype=qg.dtype, device=qg.device)
        for k0, k1, masked in runs:
            s = torch.matmul(qi, kg[:, :, k0:k1].transpose(-1, -2)).view(b, G, rep, tq, k1 - k0).mul_(scale)
            if masked:
                blocked = ~mask.block(slice(q0, q1), slice(k0, k1))
                s.masked_fill_(blocked, MASKED_SCORE)
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s.sub_(m_new.unsqueeze(-1)))
            if masked:  # rows with nothing allowed yet have m_new = MASKED_SCORE: exp(0) there
                p.masked_fill_(blocked, 0.0)
            alpha = torch.exp(m - m_new)
            l = l * alpha + p.sum(-1)
            pv = torch.matmul(p.view(b, G, rep * tq, k1 - k0), vg[:, :, k0:k1]).view(b, G, rep, tq, d)
            acc = acc * alpha.unsqueeze(-1) + pv
            m = m_new
        seen = l > 0
        safe = torch.where(seen, l, torch.ones_like(l))
        out[:, :, :, q0:q1] = acc / safe.unsqueeze(-1)
        lse[:, :, :, q0:q1] = torch.where(seen, m + torch.log(safe), MASKED_SCORE)
    return out.reshape(q.shape), lse.view(b, -1, sq)


def _backward(q, kg, vg, out, lse, dout, dlse, mask: PartialMask, sched: TileSchedule, scale: float):
    """Gradients (dq [b, H, sq, d], dk, dv [b, G, sk, d]); shapes as `_forward`, dout as out, dlse as lse."""
    G = kg.shape[1]
    qg, out, lse, dout = (_by_group(G, x) for x in (q, out, lse, dout))
    b, G, rep, sq, d = qg.shape
    dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
    # dS = P * (dP - D + dlse) with D = rowsum(dO * O).
    delta = (dout * out).sum(-1)
    if dlse is not None:
        delta = delta - _by_group(G, dlse)
    for q0, q1, qi, runs in _query_tiles(sched, qg):
        tq = q1 - q0
        doi = dout[:, :, :, q0:q1].reshape(b, G, rep * tq, d)
        li = lse[:, :, :, q0:q1].unsqueeze(-1)
        di = delta[:, :, :, q0:q1].unsqueeze(-1)
        dqi = torch.zeros_like(qi)
        for k0, k1, masked in runs:
            kc, vc, n = kg[:, :, k0:k1], vg[:, :, k0:k1], k1 - k0
            s = torch.matmul(qi, kc.transpose(-1, -2)).view(b, G, rep, tq, n).mul_(scale)
            p = torch.exp(s.sub_(li))
            if masked:  # also zeroes rows with no allowed key at all (lse = MASKED_SCORE)
                p.masked_fill_(~mask.block(slice(q0, q1), slice(k0, k1)), 0.0)
            dp = torch.matmul(doi, vc.transpose(-1, -2)).view(b, G, rep, tq, n)
            ds = p * (dp - di)
            p2, ds2 = p.view(b, G, rep * tq, n), ds.view(b, G, rep * tq, n)
            dv[:, :, k0:k1] += torch.matmul(p2.transpose(-1, -2), doi)
            dk[:, :, k0:k1] += torch.matmul(ds2.transpose(-1, -2), qi).mul_(scale)
            dqi += torch.matmul(ds2, kc).mul_(scale)
        dq[:, :, :, q0:q1] = dqi.view(b, G, rep, tq, d)
    return dq.reshape(q.shape), dk, dv


class HeadsFirstAttention(torch.autograd.Function):
    """An autograd function around a kernel pair on [b, heads, rows, d] copies in the compute
    dtype: `forward(q, k, v, mask, plan, scale) -> (out, lse)` and `backward(q, k, v, out, lse,
    dout, dlse, mask, plan, scale) -> (dq, dk, dv)`. Applied as `apply((forward, backward), q, k,
    v, mask, plan, scale)`: q [sq, b, H, d], k/v [sk, b, G, d] -> (out [sq, b, H, d], lse [b, H, sq]
    in the compute dtype)."""

    @staticmethod
    def forward(ctx, kernel, q, k, v, mask, plan, scale):
        out, lse = kernel[0](*heads_first(compute_dtype(q.dtype), q, k, v), mask, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.mask, ctx.plan, ctx.scale = kernel, mask, plan, scale
        return out.permute(2, 0, 1, 3).to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cdt = out.dtype
        do = torch.zeros_like(out) if dout is None else heads_first(cdt, dout)[0]
        dl = None if dlse is None else dlse.to(cdt)
        grads = ctx.kernel[1](*heads_first(cdt, q, k, v), out, lse, do, dl, ctx.mask, ctx.plan, ctx.scale)
        return (None,) + tuple(g.permute(2, 0, 1, 3).to(x.dtype) for g, x in zip(grads, (q, k, v))) + (None,) * 3


def check_shapes(q: torch.Tensor, k: torch.Tensor, mask: PartialMask) -> None:
    """`mask` covers q's rows x k's rows on q's device, and the query heads are a multiple of the K/V heads."""
    if mask.shape != (q.shape[0], k.shape[0]):
        raise ValueError(f"mask covers {mask.shape} (queries, keys), attention got {(q.shape[0], k.shape[0])}")
    if mask.q.block.device != q.device:
        raise ValueError(f"the mask's row vectors are on {mask.q.block.device}, q on {q.device}: mask.to(q.device)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of K/V heads {k.shape[2]}")


def tiled_partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: PartialMask,
                            softmax_scale: float, q_tile: Optional[int] = None, k_tile: Optional[int] = None):
    """q [sq, b, H, d], k/v [sk, b, G, d] (G | H) under `mask` (sq x sk row vectors); returns
    (out [sq, b, H, d], lse [b, H, sq] in fp32, fp64 for fp64 inputs)."""
    check_shapes(q, k, mask)
    sched = tile_schedule(mask, q_tile or DEFAULT_Q_TILE, k_tile or DEFAULT_K_TILE)
    return HeadsFirstAttention.apply((_forward, _backward), q, k, v, mask, sched, softmax_scale)
