"""Partial attention kernels that return the log-sum-exp, and the merge of partials, both computed
in at least fp32 (fp64 for fp64 inputs: `utils.precision.compute_dtype`).

A partial attends a set of queries to one set of keys under a boolean mask (built from row
metadata by `layout.masks.allowed`). Partials over disjoint key sets combine exactly with their
log-sum-exp statistics, which is how local noisy keys, gathered clean keys and ring chunks meet.

Shapes follow Megatron's core attention: q [sq, b, H, d], k/v [sk, b, G, d] with G | H (GQA);
outputs [sq, b, H, d] in the input dtype and lse [b, H, sq] in at least fp32.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from megatron_csbp.utils.precision import at_least_fp32, compute_dtype

# Masked scores are set to a large finite negative number rather than -inf: a query with no
# allowed key in one partial then gets a finite lse that the merge weights by exactly 0, and no
# NaN can appear in forward or backward.
MASKED_SCORE = -1.0e30


def math_partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, softmax_scale: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Explicit attention in at least fp32 (CPU or any device), differentiable in q, k, v and the lse."""
    sq, b, H, d = q.shape
    sk, G = k.shape[0], k.shape[2]
    rep = H // G
    dtype = q.dtype
    # [b, G, rep, sq, d] x [b, G, sk, d] -> [b, G, rep, sq, sk]
    qg = at_least_fp32(q).permute(1, 2, 0, 3).reshape(b, G, rep, sq, d)
    kg = at_least_fp32(k).permute(1, 2, 0, 3)
    vg = at_least_fp32(v).permute(1, 2, 0, 3)
    scores = torch.einsum("bgrqd,bgkd->bgrqk", qg, kg) * softmax_scale
    scores = scores.masked_fill(~allowed.to(scores.device), MASKED_SCORE)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bgrqk,bgkd->bgrqd", probs, vg)
    out = out.reshape(b, H, sq, d).permute(2, 0, 1, 3).to(dtype)
    return out, lse.reshape(b, H, sq)


def merge_partials(partials: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact combination of partial attentions over disjoint key sets, in at least fp32."""
    if len(partials) == 1:
        return partials[0]
    outs = torch.stack([at_least_fp32(o) for o, _ in partials])  # [n, sq, b, H, d]
    lses = torch.stack([l for _, l in partials])  # [n, b, H, sq]
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse).permute(0, 3, 1, 2).unsqueeze(-1)  # [n, sq, b, H, 1]
    out = (weights * outs).sum(0).to(partials[0][0].dtype)
    return out, lse


_FLEX = {}


def _flex_attention_fn(device: torch.device):
    """FlexAttention, compiled on CUDA (its fused kernel); eager elsewhere (tests on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "compiled" not in _FLEX:
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["compiled"]


def _block_mask(allowed: torch.Tensor, device: torch.device):
    """Block mask of a (static, cached) bool mask; built once per mask tensor."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (allowed.data_ptr(), tuple(allowed.shape), str(device))
    if key not in _FLEX:
        dense = allowed.to(device)

        def mask_mod(batch, head, qi, ki):
            return dense[qi, ki]

        _FLEX[key] = (allowed, create_block_mask(mask_mod, None, None, *dense.shape, device=device))
    return _FLEX[key][1]


def flex_partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, softmax_scale: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention with the same mask (GPU path; torch has no FlexAttention backward on CPU).

    Masks are static per plan and cached by the plan, so their block masks are built once."""
    sq, b, H, d = q.shape
    G = k.shape[2]
    block_mask = _block_mask(allowed, q.device)
    qt, kt, vt = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    flex = _flex_attention_fn(q.device)
    try:  # torch >= 2.9: auxiliary outputs are requested with AuxRequest
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = flex(qt, kt, vt, block_mask=block_mask, scale=softmax_scale, enable_gqa=G != H,
                        return_aux=AuxRequest(lse=True))
        lse = aux.lse
    except ImportError:
        out, lse = flex(qt, kt, vt, block_mask=block_mask, scale=softmax_scale, enable_gqa=G != H, return_lse=True)
    # Rows with no allowed key get -inf: clamp so the merge weights them by exactly zero, like
    # the math kernel.
    lse = lse.to(compute_dtype(q.dtype)).clamp_min(MASKED_SCORE)
    return out.permute(2, 0, 1, 3), lse


KERNELS = {"math": math_partial_attention, "flex": flex_partial_attention}


def get_kernel(name: str, device: torch.device):
    """'auto' picks FlexAttention on CUDA and the explicit math kernel elsewhere."""
    if name == "auto":
        name = "flex" if device.type == "cuda" else "math"
    if name not in KERNELS:
        raise ValueError(f"--attention-kernel must be one of {sorted(KERNELS) + ['auto']}, got {name!r}")
    return KERNELS[name]
