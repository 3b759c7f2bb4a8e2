"""The GPU `flash` decomposition run on CPU with torch's CPU flash attention
(`--attention-kernel cpu_flash`, the default on CPU).

`FlashPlan`'s varlen sequences run as `aten._scaled_dot_product_flash_attention_for_cpu` calls on
views or gathered rows, windowed runs and the fallback on the tiled kernel, merged by log-sum-exp
in one autograd function. Pieces, backward (the lse gradient through out'), error bound and memory:
docs/attention-kernels.md#cpu_flash-attentioncpu_flashpy-default-on-cpu.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, partial
from itertools import accumulate
from typing import List, Tuple, Union

import torch

from megatron_csbp.attention.kernels.flash import FlashPlan, VarlenCall
from megatron_csbp.attention.kernels.tiled import (
    MASKED_SCORE,
    HeadsFirstAttention,
    _backward as tiled_backward,
    _forward as tiled_forward,
    check_shapes,
    tile_schedule,
)
from megatron_csbp.layout.rows import PartialMask, index_runs as _runs

# Rows of a piece: one contiguous range (a view), a few ranges (gathered by concatenating views:
# no index vector kept in the plan) or an index vector.
Rows = Union[slice, Tuple[slice, ...], torch.Tensor]

# A sequence whose keys lie in at most this many contiguous ranges of key rows runs as one call
# per range (views, merged by lse) instead of gathering its keys: gathered or ring-received
# clean keys of P ranks come in <= 2P ranges of positions (mirrored ownership).
FREE_RUNS = 16

# Adjacent same-shape sequences on views (whole noisy blocks) run as one batched call of at most
# this many query rows (`_stacked`); its copies of q, k, v and out are bounded by it: at most 8 MiB
# each at 32 heads x d 128 in fp32, whatever the length (the same at 256K tokens on 16 ranks).
STACK_ROWS = 512

_fa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_fa_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _rows(index: torch.Tensor) -> Rows:
    """A slice when `index` is one increasing run of consecutive rows (a view), its runs when it
    has at most FREE_RUNS of them (a query group of a noisy block and the clean block sharing its
    keys is two), else the index."""
    breaks = int((index[1:] != index[:-1] + 1).sum()) if index.numel() else FREE_RUNS
    if breaks == 0:
        return slice(int(index[0]), int(index[0]) + index.numel())
    return tuple(_runs(index)) if breaks < FREE_RUNS else index


def _count(rows: Rows) -> int:
    if isinstance(rows, tuple):
        return sum(_count(r) for r in rows)
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Rows along dim 2 of [b, heads, rows, d] (or [b, heads, rows]): a view of a slice, one
    concatenation of the views of a few runs (no index vector: building one and gathering by it
    cost twice the concatenation for CSBP's query runs), an index gather otherwise."""
    if isinstance(rows, slice):
        return x[:, :, rows]
    if isinstance(rows, tuple):
        return torch.cat([x[:, :, r] for r in rows], dim=2)
    return x.index_select(2, rows)


def _run_index(runs: Tuple[slice, ...], device=None) -> torch.Tensor:
    """The rows of `runs` as one index vector, built in a fixed handful of ops whatever the number
    of runs (no arange per run)."""
    starts = torch.tensor([r.start for r in runs], device=device)
    lens = torch.tensor([r.stop - r.start for r in runs], device=device)
    shift = torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens)
    return torch.arange(shift.numel(), device=device) + shift


def _put(x: torch.Tensor, rows: Rows, value: torch.Tensor, add: bool = False) -> None:
    """Write (or with `add`, add) `value` into `rows` along dim 2 of `x`."""
    if isinstance(rows, tuple):  # each run from its rows of `value`
        at = [0, *accumulate(r.stop - r.start for r in rows)]
        for r, a, b in zip(rows, at, at[1:]):
            _put(x, r, value[:, :, a:b], add)
    elif isinstance(rows, slice) and add:
        x[:, :, rows] += value
    elif isinstance(rows, slice):
        x[:, :, rows] = value
    else:
        (x.index_add_ if add else x.index_copy_)(2, rows, value)


def _add(x: torch.Tensor, rows: Rows, value: torch.Tensor) -> None:
    _put(x, rows, value, add=True)


@dataclass(frozen=True)
class FlashPiece:
    """One CPU flash call: `seqs` sequences of nq queries x nk keys; q/k rows in sequence order
    (a slice when seqs == 1 and the rows are contiguous). `causal`: top-left, square."""

    q: Rows
    k: Rows
    seqs: int
    causal: bool


@dataclass(frozen=True)
class TiledPiece:
    """Queries `q` x keys `k` on the tiled kernel under their own sub-mask."""

    q: Rows
    k: Rows
    mask: PartialMask


@dataclass(frozen=True)
class RunGroup:
    """Consecutive flash pieces whose queries lie in a few runs each (a noisy block and the clean
    block sharing its clean prefix), no row covered twice nor by an earlier piece: their query
    rows are gathered once per direction for the whole group (one gather of q, dO, out, lse; one
    scatter of out, lse and dq), and each member reads a view of the gathered rows (`members`:
    FlashPieces whose q is a slice of them). Per member that replaces a concatenation of each
    tensor and a slice write per run: CSBP's own chunk has one such piece per clean block. At
    most STACK_ROWS rows per group; a member writes its out, lse and dq over its rows of the gathered
    buffers (no buffer beyond them: the peak of CSBP P = 4, L = 2K all-gather rose 0.19 MiB above
    CP's with separate output buffers, and is unchanged to the byte without them). The
    plan keeps the runs (no index vector); the index is built per call, ~5 small ops. At 256K
    tokens on 16 ranks: a group's index is at most 4 KiB and its gathered copies at most 8 MiB
    each (512 rows x 32 heads x d 128, fp32), whatever the length."""

    pieces: Tuple[FlashPiece, ...]  # what the group replaces: its q rows are runs of the partial's rows

    @cached_property
    def q(self) -> Tuple[slice, ...]:
        """Every member's query runs, in member order."""
        return tuple(r for p in self.pieces for r in p.q)

    @cached_property
    def members(self) -> Tuple[FlashPiece, ...]:
        """Each piece on its rows of the gathered runs."""
        at = [0, *accumulate(_count(p.q) for p in self.pieces)]
        return tuple(FlashPiece(slice(a, b), p.k, 1, p.causal) for p, a, b in zip(self.pieces, at, at[1:]))


@dataclass(frozen=True)
class CpuFlashPlan:
    pieces: Tuple[Union[FlashPiece, TiledPiece, RunGroup], ...]
    # per piece: whether no earlier piece covers any of its rows (static: the forward merge copies
    # such a piece instead of merging it, with no per-call bookkeeping of the rows seen)
    firsts: Tuple[bool, ...] = ()

    @staticmethod
    def of(mask: PartialMask) -> "CpuFlashPlan":
        fp = FlashPlan.of(mask, free_runs=FREE_RUNS)
        pieces: List[Union[FlashPiece, TiledPiece]] = []
        # The noisy call last: its (stacked) pieces then merge once into the rows the clean
        # prefixes reached first, instead of each prefix piece merging into its noisy block's
        # rows (CSBP's own chunk: one merge over the noisy rows instead of one per block).
        for call in list(fp.clean) + ([fp.noisy] if fp.noisy is not None else []):
            pieces += _pieces_of(call, mask)
        if fp.fallback_mask is not None:
            pieces.append(TiledPiece(_rows(fp.fallback_q), _rows(fp.clean_keys), fp.fallback_mask))
        seen, firsts = torch.zeros(mask.shape[0], dtype=torch.bool), []
        for p in pieces:
            rows = _run_index(p.q) if isinstance(p.q, tuple) else p.q
            firsts.append(not bool(seen[rows].any()))
            seen[rows] = True
        return CpuFlashPlan(*_grouped_runs(pieces, firsts))

    @property
    def nbytes(self) -> int:
        """Bytes of the index vectors and sub-masks (slices cost nothing)."""
        calls = self.calls
        vectors = sum(r.numel() * r.element_size() for p in calls for r in (p.q, p.k) if isinstance(r, torch.Tensor))
        return vectors + sum(p.mask.nbytes + p.mask.derived_nbytes() for p in calls if isinstance(p, TiledPiece))

    @property
    def calls(self) -> Tuple[Union[FlashPiece, TiledPiece], ...]:
        """Every kernel call in order, a group's members in the partial's rows."""
        return tuple(c for p in self.pieces for c in (p.pieces if isinstance(p, RunGroup) else (p,)))

    @property
    def flash_calls(self) -> int:
        return sum(isinstance(p, FlashPiece) for p in self.calls)


def _grouped_runs(pieces, firsts):
    """`pieces` with each stretch of consecutive first-covering single-sequence flash pieces whose
    queries are runs (`Tuple` rows) as one RunGroup of at most STACK_ROWS rows."""
    out, out_firsts, group = [], [], []

    def close():
        if group:
            out.append(group[0] if len(group) == 1 else RunGroup(tuple(group)))
            out_firsts.append(True)
        group.clear()

    for p, first in zip(pieces, firsts):
        if isinstance(p, FlashPiece) and isinstance(p.q, tuple) and p.seqs == 1 and first:
            if sum(_count(g.q) for g in group) + _count(p.q) > STACK_ROWS:
                close()
            group.append(p)
            continue
        close()
        out.append(p)
        out_firsts.append(first)
    close()
    return tuple(out), tuple(out_firsts)


def _pieces_of(call: VarlenCall, mask: PartialMask) -> List[Union[FlashPiece, TiledPiece]]:
    out: List[Union[FlashPiece, TiledPiece]] = []
    if not call.causal:
        # Keys in few contiguous ranges: a call per range on views (queries gathered if they are
        # not contiguous). Otherwise the sequence is gathered, and gathered sequences of one
        # shape go in one call.
        by_shape = {}
        for qs, ks in call.sequences():
            runs = _runs(ks)
            if len(runs) <= FREE_RUNS:
                qr = _rows(qs)
                out += [FlashPiece(qr, kr, 1, False) for kr in runs]
            else:
                by_shape.setdefault((qs.numel(), ks.numel()), []).append((qs, ks))
        for group in by_shape.values():
            out.append(FlashPiece(torch.cat([g[0] for g in group]), torch.cat([g[1] for g in group]), len(group), False))
        return _stacked(out)
    for qs, ks in call.sequences():
        nq, nk = qs.numel(), ks.numel()
        if call.window[0] >= 0 or nk < nq:  # windowed (or keys short of the diagonal): masked tiles
            out.append(TiledPiece(_rows(qs), _rows(ks), PartialMask(mask.q.select(qs), mask.k.select(ks))))
            continue
        qr = _rows(qs)
        if nk > nq:  # bottom-right causal = the rectangle before the diagonal + a top-left causal square
            rect = _runs(ks[:nk - nq])
            out += [FlashPiece(qr, kr, 1, False) for kr in rect] if len(rect) <= FREE_RUNS else \
                [FlashPiece(qr, ks[:nk - nq], 1, False)]
        out.append(FlashPiece(qr, _rows(ks[nk - nq:]), 1, True))
    return out


def _stacked(pieces: List[FlashPiece]) -> List[FlashPiece]:
    """Consecutive single-sequence pieces of one shape on adjacent views (q rows [a, a + n),
    [a + n, a + 2n), ... against keys [c, c + m), [c + m, c + 2m), ...: the whole noisy blocks of
    a rank) as one batched call, up to STACK_ROWS query rows: a CPU flash call costs a fixed
    ~60 us forward + backward beyond its pairs, which made the per-block calls most of a
    short sequence's attention time (L = 1024, block 16: 16 of a rank's ~35-50 calls per layer).
    The batched call copies its rows (`_batched`): at most STACK_ROWS rows of q, k, v and out."""
    out: List[FlashPiece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (last is not None and _stackable(p) and _stackable(last)
                and (p.q.start, p.k.start) == (last.q.stop, last.k.stop)
                and (_count(p.q), _count(p.k)) == (_count(last.q) // last.seqs, _count(last.k) // last.seqs)
                and _count(last.q) + _count(p.q) <= STACK_ROWS):
            out[-1] = FlashPiece(slice(last.q.start, p.q.stop), slice(last.k.start, p.k.stop), last.seqs + 1, False)
        else:
            out.append(p)
    return out


def _stackable(p: FlashPiece) -> bool:
    return isinstance(p.q, slice) and isinstance(p.k, slice) and not p.causal


def cpu_flash_plan(mask: PartialMask) -> CpuFlashPlan:
    return mask.derived("cpu_flash", lambda: CpuFlashPlan.of(mask.to("cpu")))


def _batched(x: torch.Tensor, rows: Rows, seqs: int) -> torch.Tensor:
    """[b, h, rows, d] -> the piece's [b * seqs, h, n, d]."""
    t = _take(x, rows)
    if seqs == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h, seqs, n // seqs, d).transpose(1, 2).reshape(b * seqs, h, n // seqs, d)


def _unbatched(x: torch.Tensor, b: int, seqs: int) -> torch.Tensor:
    """[b * seqs, h, n, (d)] -> [b, h, seqs * n, (d)]."""
    if seqs == 1:
        return x
    tail = x.shape[3:]
    return x.view(b, seqs, *x.shape[1:]).transpose(1, 2).reshape(b, x.shape[1], seqs * x.shape[2], *tail)


class _Merge:
    """Running log-sum-exp merge of pieces into [b, H, sq, d] / [b, H, sq] accumulators."""

    def __init__(self, b, H, sq, d, dtype, device):
        self.out = torch.zeros(b, H, sq, d, dtype=dtype, device=device)
        self.lse = torch.full((b, H, sq), MASKED_SCORE, dtype=dtype, device=device)

    def add(self, rows: Rows, out: torch.Tensor, lse: torch.Tensor, first: bool) -> None:
        """Merge a piece's (out, lse) on `rows`; `first`: no earlier piece covered them (copy)."""
        if not first:
            old_l, old_o = _take(self.lse, rows), _take(self.out, rows)
            new = torch.logaddexp(old_l, lse)
            out = old_o * torch.exp(old_l - new).unsqueeze(-1) + out * torch.exp(lse - new).unsqueeze(-1)
            lse = new
        _put(self.out, rows, out)
        _put(self.lse, rows, lse)


def _forward(qc, kc, vc, mask: PartialMask, plan: CpuFlashPlan, scale: float):
    b, H, sq, d = qc.shape
    merge = _Merge(b, H, sq, d, qc.dtype, qc.device)
    for p, first in zip(plan.pieces, plan.firsts):
        if isinstance(p, FlashPiece):
            bq, bk = partial(_batched, rows=p.q, seqs=p.seqs), partial(_batched, rows=p.k, seqs=p.seqs)
            o, lse = _fa(bq(qc), bk(kc), bk(vc), 0.0, p.causal, scale=scale)
            merge.add(p.q, _unbatched(o, b, p.seqs), _unbatched(lse, b, p.seqs), first)
        elif isinstance(p, RunGroup):  # first by construction: written, not merged
            idx = _run_index(p.q, qc.device)
            qg = qc.index_select(2, idx)
            lg = qg.new_empty(qg.shape[:3])
            for m in p.members:  # a member's output replaces its queries (read only by its own call)
                qg[:, :, m.q], lg[:, :, m.q] = _fa(qg[:, :, m.q], _take(kc, m.k), _take(vc, m.k), 0.0, m.causal,
                                                   scale=scale)
            merge.add(idx, qg, lg, True)
        else:
            o, lse = tiled_forward(_take(qc, p.q), _take(kc, p.k), _take(vc, p.k), p.mask, tile_schedule(p.mask), scale)
            merge.add(p.q, o, lse, first)
    return merge.out, merge.lse.clamp_min(MASKED_SCORE)


def _backward(qc, kc, vc, out, lse, dout, dlse, mask: PartialMask, plan: CpuFlashPlan, scale: float):
    b, H, sq, d = qc.shape
    dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
    do_f, dlse_f = dout, dlse  # what the pieces read
    fix = None  # c [b, H, sq, 1]: out' = out - c dO has rowsum(dO * out') = D - dlse
    rare = None
    if dlse is not None and bool((dlse != 0).any()):
        n2 = torch.linalg.vector_norm(dout, dim=-1, dtype=torch.float64).square_()
        # dlse / 0 (dO row zero) or a quotient past the dtype's range: inf; 0 / 0: nan, no fix needed
        c = torch.nan_to_num_((dlse / n2).to(dout.dtype), nan=0.0, posinf=torch.inf, neginf=-torch.inf)
        bad = c.isinf()
        fix = c.unsqueeze(-1)
        if bool(bad.any()):  # these rows leave the pieces and go through the tiled backward whole
            fix = fix.masked_fill(bad.unsqueeze(-1), 0.0)
            rare = bad.flatten(0, 1).any(0).nonzero().flatten()
            keep = torch.ones(sq, dtype=dout.dtype, device=dout.device)
            keep[rare] = 0
            do_f, dlse_f = dout * keep[:, None], dlse * keep
    for p in plan.pieces:
        if isinstance(p, FlashPiece):
            bq, bk = partial(_batched, rows=p.q, seqs=p.seqs), partial(_batched, rows=p.k, seqs=p.seqs)
            out_p, do_p = bq(out), bq(do_f)
            if fix is not None:  # the piece's rows of out' (a copy of those rows only)
                out_p = torch.addcmul(out_p, bq(fix), do_p, value=-1)
            grads = _fa_bwd(do_p, bq(qc), bk(kc), bk(vc), out_p, bq(lse.unsqueeze(-1)).squeeze(-1), 0.0, p.causal,
                            scale=scale)
            for total, rows, grad in zip((dq, dk, dv), (p.q, p.k, p.k), grads):
                _add(total, rows, _unbatched(grad, b, p.seqs))
        elif isinstance(p, RunGroup):
            idx = _run_index(p.q, qc.device)
            do_g, q_g, out_g, lse_g = (x.index_select(2, idx) for x in (do_f, qc, out, lse))
            if fix is not None:
                out_g.addcmul_(fix.index_select(2, idx), do_g, value=-1)
            for m in p.members:  # a member's dq replaces its queries (read only by its own call)
                q_g[:, :, m.q], gk, gv = _fa_bwd(do_g[:, :, m.q], q_g[:, :, m.q], _take(kc, m.k), _take(vc, m.k),
                                                 out_g[:, :, m.q], lse_g[:, :, m.q], 0.0, m.causal, scale=scale)
                _add(dk, m.k, gk)
                _add(dv, m.k, gv)
            dq.index_add_(2, idx, q_g)
        else:
            _tiled_piece_backward(qc, kc, vc, out, lse, do_f, dlse_f, p.q, p.k, p.mask, scale, dq, dk, dv)
    if rare is not None:
        rows = _rows(rare)
        sub = PartialMask(mask.q.select(rare.to(mask.q.block.device)), mask.k)
        _tiled_piece_backward(qc, kc, vc, out, lse, dout, dlse, rows, slice(0, kc.shape[2]), sub, scale, dq, dk, dv)
    return dq, dk, dv


def _tiled_piece_backward(qc, kc, vc, out, lse, dout, dlse, q_rows, k_rows, mask, scale, dq, dk, dv):
    take = lambda x: None if x is None else _take(x, q_rows)  # noqa: E731
    gq, gk, gv = tiled_backward(take(qc), _take(kc, k_rows), _take(vc, k_rows), take(out), take(lse), take(dout),
                                take(dlse), mask, tile_schedule(mask), scale)
    _add(dq, q_rows, gq)
    _add(dk, k_rows, gk)
    _add(dv, k_rows, gv)


def cpu_flash_partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: PartialMask,
                                softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [sq, b, H, d], k/v [sk, b, G, d] (G | H) under `mask`; returns (out [sq, b, H, d],
    lse [b, H, sq] in fp32, fp64 for fp64 inputs). CPU tensors."""
    check_shapes(q, k, mask)
    if q.device.type != "cpu":
        raise ValueError(f"--attention-kernel cpu_flash runs on CPU, got {q.device}")
    return HeadsFirstAttention.apply((_forward, _backward), q, k, v, mask, cpu_flash_plan(mask), softmax_scale)


# It takes a rank's local rows as one partial without loss (whole noisy blocks and clean prefixes
# are flash calls on slices of its own plan): `strategies.NoisyThenClean` then runs no separate
# noisy part and no noisy/clean merge.
cpu_flash_partial_attention.one_local_partial = True
