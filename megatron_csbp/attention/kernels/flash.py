"""flash-attn (2.x, `flash_attn_varlen_func`) for the pieces of a partial it expresses exactly,
FlexAttention for the rest, merged by log-sum-exp (`--attention-kernel flash`, CUDA, fp16/bf16).

`FlashPlan.of(mask)` splits the allowed pairs into a noisy layer (one non-causal varlen call, a
sequence per block) and a clean layer (dense groups, causal runs per window, a flex remainder).
Requires flash-attn >= 2.3. The decomposition, the exact lse gradient and plan sizes:
docs/attention-kernels.md#flash-attentionflashpy.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

import torch

from megatron_csbp.attention.kernels.flex import flex_attention_partial, no_pairs
from megatron_csbp.attention.merge import merge_partials
from megatron_csbp.attention.kernels.tiled import MASKED_SCORE
from megatron_csbp.layout.rows import PartialMask
from megatron_csbp.utils.precision import compute_dtype

KEY_COPY_BUDGET = 2.0  # gathered clean keys per call, at most this many x the partial's clean keys
_MISSING = "--attention-kernel flash needs flash-attn; pip install flash-attn"


def require_flash_attn() -> Callable:
    """flash_attn.flash_attn_varlen_func, or a clear error naming the flag."""
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:
        raise RuntimeError(_MISSING) from exc
    major, minor = (int(x) for x in flash_attn.__version__.split(".")[:2])
    if (major, minor) < (2, 3):
        raise RuntimeError(f"--attention-kernel flash needs flash-attn >= 2.3 (window_size), found {flash_attn.__version__}")
    return flash_attn_varlen_func


@dataclass(frozen=True)
class VarlenCall:
    """One flash_attn_varlen_func call (batch 1): partial rows `q_index` / `k_index` in packed
    order, sequence boundaries `cu_q` / `cu_k` (int32, [sequences + 1])."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    window: Tuple[int, int] = (-1, -1)

    def to(self, device) -> "VarlenCall":
        return replace(self, **{f: getattr(self, f).to(device) for f in ("q_index", "k_index", "cu_q", "cu_k")})

    def sequences(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(query rows, key rows) of each sequence."""
        cq, ck = self.cu_q.long().tolist(), self.cu_k.long().tolist()
        return [(self.q_index[a:b], self.k_index[c:d]) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]

    def pairs(self) -> torch.Tensor:
        """The (query row, key row) pairs this call attends, int64 [n, 2]: for tests (O(pairs))."""
        out = []
        for qs, ks in self.sequences():
            nq, nk = qs.numel(), ks.numel()
            qi, ki = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
            ok = torch.ones(nq, nk, dtype=torch.bool)
            if self.causal:  # bottom-right aligned, window (left, 0)
                last = qi + nk - nq
                ok = ki <= last
                if self.window[0] >= 0:
                    ok &= ki >= last - self.window[0]
            a, b = ok.nonzero().unbind(1)
            out.append(torch.stack([qs[a], ks[b]], 1))
        return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)


def _cu(counts: torch.Tensor) -> torch.Tensor:
    """Sequence boundaries (int32 [n + 1]) of sequences of `counts` rows."""
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)


def _noisy_call(q, k) -> Optional[VarlenCall]:
    """Noisy query rows grouped by block, noisy key rows by block, blocks on both sides kept, in
    order: one non-causal sequence per block (None without any)."""
    q_rows, k_rows = (~q.is_clean).nonzero().flatten(), (~k.is_clean).nonzero().flatten()
    q_keys, k_keys = q.block[q_rows].long(), k.block[k_rows].long()
    common = torch.unique(q_keys)[torch.isin(torch.unique(q_keys), k_keys)]
    qm, km = torch.isin(q_keys, common), torch.isin(k_keys, common)
    if not bool(qm.any()):
        return None
    q_rows, q_keys, k_rows, k_keys = q_rows[qm], q_keys[qm], k_rows[km], k_keys[km]
    qo, ko = torch.argsort(q_keys, stable=True), torch.argsort(k_keys, stable=True)
    qc = torch.unique_consecutive(q_keys[qo], return_counts=True)[1]
    kc = torch.unique_consecutive(k_keys[ko], return_counts=True)[1]
    return VarlenCall(q_rows[qo], k_rows[ko], _cu(qc), _cu(kc), int(qc.max()), int(kc.max()), causal=False)


def _causal_runs(rows, s, e):
    """Split rows (sorted by e, each with a unique (s, e)) into maximal runs with e[i+1] = e[i]+1;
    return the runs that one causal sequence expresses: (rows, segment start, left) each."""
    if rows.numel() == 0:
        return []
    breaks = (torch.nonzero(e[1:] != e[:-1] + 1).flatten() + 1).tolist()
    runs = []
    for a, b in zip([0] + breaks, breaks + [rows.numel()]):
        rr, ss, ee = rows[a:b], s[a:b], e[a:b]
        k0 = int(ss.min())
        if int(ss[0]) != k0 or rr.numel() < 2:
            continue
        lefts = (ee - 1 - ss)[ss > k0]  # the window of the queries whose keys start past k0
        if not lefts.numel():  # every query's keys start at k0: no window
            runs.append((rr, k0, -1))
        elif bool((lefts == lefts[0]).all()) and bool((ss == torch.clamp(ee - 1 - lefts[0], min=k0)).all()):
            runs.append((rr, k0, int(lefts[0])))
    return runs


@dataclass(frozen=True)
class FlashPlan:
    """The decomposition of one PartialMask: `noisy` (one call or None), `clean` calls, and the
    queries whose clean part runs on flex (`fallback_q`, over all clean keys `clean_keys`, with
    its sub-mask `fallback_mask`)."""

    noisy: Optional[VarlenCall]
    clean: List[VarlenCall]
    clean_keys: torch.Tensor
    fallback_q: torch.Tensor
    fallback_mask: Optional[PartialMask]

    @staticmethod
    def of(mask: PartialMask, key_copy_budget: float = KEY_COPY_BUDGET, free_runs: int = 0) -> "FlashPlan":
        """`free_runs`: a group whose clean keys lie in at most this many contiguous ranges of key
        rows costs no key copies (an executor that slices instead of packing, one call per range:
        `attention/cpu_flash.py`)."""
        m = mask.to("cpu")
        q, k = m.q, m.k
        noisy = _noisy_call(q, k)  # the noisy layer: block-diagonal after gathering by block
        # Clean layer: each query's keys are the sorted clean keys [s, e).
        kc = k.is_clean.nonzero().flatten()
        pos = k.position[kc].long()
        order = torch.argsort(pos, stable=True)
        clean_keys, pos = kc[order], pos[order]
        s = torch.searchsorted(pos, q.lo.long())
        e = torch.searchsorted(pos, q.hi.long())
        active = (e > s).nonzero().flatten()
        # Causal runs, among clean queries and among noisy queries separately (a token-causal
        # clean query shares its keys with a block of noisy queries): one representative row per
        # distinct (s, e), sorted by e. The other rows form dense groups of identical (s, e).
        n_pos = pos.numel() + 1
        runs, in_runs = [], []
        for kind in (q.is_clean[active], ~q.is_clean[active]):
            rows = active[kind]
            ss, ee = s[rows], e[rows]
            pair = ss * n_pos + ee
            perm = torch.argsort(pair, stable=True)
            counts = torch.unique_consecutive(pair[perm], return_counts=True)[1]
            reps = perm[counts.cumsum(0) - counts]  # the first row of each distinct (s, e)
            reps = reps[torch.argsort(ee[reps] * n_pos + ss[reps], stable=True)]
            r = _causal_runs(rows[reps], ss[reps], ee[reps])
            runs += r
            in_runs += [x[0] for x in r]
        taken_rows = torch.cat(in_runs) if in_runs else active[:0]
        rest = active[~torch.isin(active, taken_rows)]
        # Candidate sequences: (cost in gathered keys, kind, q rows, k0, k1, left)
        cands = [(int(e[r[-1]]) - k0, "causal", r, k0, int(e[r[-1]]), left) for r, k0, left in runs]
        if rest.numel():  # dense groups of identical (s, e)
            dp = s[rest] * n_pos + e[rest]
            do = torch.argsort(dp, stable=True)
            dense_rows, dp = rest[do], dp[do]
            cnt = torch.unique_consecutive(dp, return_counts=True)[1]
            for grp in torch.split(dense_rows, cnt.tolist()):
                a, b = int(s[grp[0]]), int(e[grp[0]])
                cands.append((b - a, "dense", grp, a, b, -1))
        if free_runs and cands:  # clean_keys[k0:k1] in few runs of consecutive rows: sliced, not copied
            run = torch.cat([torch.zeros(1, dtype=torch.long), (clean_keys[1:] != clean_keys[:-1] + 1).long().cumsum(0)])
            cands = [(0 if run[c[4] - 1] - run[c[3]] < free_runs else c[0],) + c[1:] for c in cands]
        # Cheapest first (keys gathered per query), within the copy budget.
        cands.sort(key=lambda c: (c[0] / c[2].numel(), c[3]))
        budget, taken, fallback = key_copy_budget * max(1, pos.numel()), [], []
        for c in cands:
            if c[0] <= budget:
                budget -= c[0]
                taken.append(c)
            else:
                fallback.append(c[2])
        calls = []
        for kind, left in sorted({(c[1], c[5]) for c in taken}):
            group = sorted((c for c in taken if (c[1], c[5]) == (kind, left)), key=lambda c: (c[3], c[4]))
            qs = [c[2] for c in group]
            ks = [torch.arange(c[3], c[4]) for c in group]
            nq, nk = (torch.tensor([x.numel() for x in xs]) for xs in (qs, ks))
            calls.append(VarlenCall(torch.cat(qs), clean_keys[torch.cat(ks)], _cu(nq), _cu(nk), int(nq.max()),
                                    int(nk.max()), causal=kind == "causal", window=(left, 0) if kind == "causal" else (-1, -1)))
        fallback_q = torch.sort(torch.cat(fallback)).values if fallback else torch.zeros(0, dtype=torch.long)
        fallback_mask = PartialMask(q.select(fallback_q), k.select(clean_keys)) if fallback_q.numel() else None
        return FlashPlan(noisy, calls, clean_keys, fallback_q, fallback_mask)

    @property
    def nbytes(self) -> int:
        """Bytes of the index vectors (the fallback's flex tables are counted on its own mask)."""
        calls = ([self.noisy] if self.noisy is not None else []) + self.clean
        vecs = [t for c in calls for t in (c.q_index, c.k_index, c.cu_q, c.cu_k)] + [self.clean_keys, self.fallback_q]
        rows = self.fallback_mask.nbytes if self.fallback_mask is not None else 0
        return rows + sum(t.numel() * t.element_size() for t in vecs)

    def to(self, device) -> "FlashPlan":
        fm = self.fallback_mask.to(device) if self.fallback_mask is not None else None
        return FlashPlan(self.noisy.to(device) if self.noisy is not None else None, [c.to(device) for c in self.clean],
                         self.clean_keys.to(device), self.fallback_q.to(device), fm)


def flash_plan(mask: PartialMask, device) -> FlashPlan:
    """The mask's FlashPlan on `device`, built once and cached on the mask."""
    return mask.derived(("flash", str(device)), lambda: FlashPlan.of(mask).to(device))


def _lse_rows(lse: torch.Tensor, cu: torch.Tensor, total: int) -> torch.Tensor:
    """Varlen lse as [H, total]: flash-attn 2.x returns (nheads, total_q); some older 2.x
    releases (batch, nheads, max_seqlen_q), padded per sequence."""
    if lse.dim() == 2:
        return lse
    seq = torch.searchsorted(cu[1:].long(), torch.arange(total, device=lse.device), right=True)
    return lse[seq, :, torch.arange(total, device=lse.device) - cu.long()[seq]].T


def _run(fa, q, k, v, call: VarlenCall, scale: float):
    """One varlen call on partial rows; returns (out [n, b, H, d], lse [b, H, n] fp32)."""
    b, H = q.shape[1], q.shape[2]
    n, m = call.q_index.numel(), call.k_index.numel()

    def pack(x, idx):  # [rows, b, h, d] -> [b * len(idx), h, d], batch-major
        return x.index_select(0, idx).transpose(0, 1).reshape(b * idx.numel(), x.shape[2], x.shape[3])

    def cu_b(cu, rows):  # the same sequences once per batch element, batch-major
        starts = cu[:-1][None, :] + rows * torch.arange(b, device=cu.device, dtype=cu.dtype)[:, None]
        return torch.cat([starts.flatten(), cu[-1:] + (b - 1) * rows]).to(torch.int32)

    qp, kp, vp = pack(q, call.q_index), pack(k, call.k_index), pack(v, call.k_index)
    cq, ck = cu_b(call.cu_q, n), cu_b(call.cu_k, m)
    args = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=call.max_q, max_seqlen_k=call.max_k, dropout_p=0.0,
                softmax_scale=scale, causal=call.causal, window_size=call.window)
    out, lse, _ = fa(qp, kp, vp, return_attn_probs=True, **args)
    lse = _lse_rows(lse, cq, b * n).to(compute_dtype(q.dtype))  # [H, b*n]
    if torch.is_grad_enabled() and (qp.requires_grad or kp.requires_grad):
        ok = fa(qp.detach(), kp.detach(), kp, **args)  # (P @ K) per query, differentiable in K only
        a = (qp.to(lse.dtype) * ok.detach().to(lse.dtype)).sum(-1)
        c = (qp.detach().to(lse.dtype) * ok.to(lse.dtype)).sum(-1)
        lse = lse + scale * ((a - a.detach()) + (c - c.detach())).T
    out = out.reshape(b, n, H, -1).transpose(0, 1)
    return out, lse.reshape(H, b, n).transpose(0, 1)


def flash_attention_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: PartialMask, softmax_scale: float,
                            *, flash_fn: Optional[Callable] = None, fallback: Callable = flex_attention_partial):
    """One partial: flash-attn varlen calls of the mask's FlashPlan plus `fallback` (FlexAttention)
    for the queries flash cannot take within the key-copy budget, merged by log-sum-exp.
    `flash_fn` defaults to flash_attn.flash_attn_varlen_func."""
    fa = flash_fn if flash_fn is not None else require_flash_attn()
    if flash_fn is None and (q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16)):
        raise ValueError(f"--attention-kernel flash runs fp16/bf16 on CUDA, got {q.dtype} on {q.device}")
    sq, b, H, d = q.shape
    if mask.shape != (sq, k.shape[0]):
        raise ValueError(f"mask is {mask.shape}, q/k have ({sq}, {k.shape[0]}) rows")
    plan = flash_plan(mask, q.device)

    def layer(pieces):
        """Pieces over disjoint query sets -> one partial over all sq rows (others: 0, MASKED)."""
        idx = torch.cat([p[0] for p in pieces])
        out = q.new_zeros(sq, b, H, v.shape[-1]).index_copy(0, idx, torch.cat([p[1].to(q.dtype) for p in pieces]))
        lse = torch.full((b, H, sq), MASKED_SCORE, dtype=compute_dtype(q.dtype), device=q.device)
        return out, lse.index_copy(2, idx, torch.cat([p[2].to(lse.dtype) for p in pieces], dim=2))

    layers = []
    if plan.noisy is not None:
        o, l = _run(fa, q, k, v, plan.noisy, softmax_scale)
        layers.append(layer([(plan.noisy.q_index, o, l)]))
    clean = [(c.q_index,) + _run(fa, q, k, v, c, softmax_scale) for c in plan.clean]
    if plan.fallback_mask is not None:
        fq = plan.fallback_q
        o, l = fallback(q.index_select(0, fq), k.index_select(0, plan.clean_keys), v.index_select(0, plan.clean_keys),
                        plan.fallback_mask, softmax_scale)
        clean.append((fq, o, l))
    if clean:
        layers.append(layer(clean))
    if not layers:  # no allowed pair at all
        return no_pairs(q, k, v)
    out, lse = merge_partials(layers)
    return out, lse.clamp_min(MASKED_SCORE)
