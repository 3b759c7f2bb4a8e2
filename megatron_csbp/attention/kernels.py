"""Partial attention kernels that return the log-sum-exp, and the fp32 merge of partials.

A partial attends a set of queries to one set of keys under a boolean mask (built from row
metadata by `layout.masks.allowed`). Partials over disjoint key sets combine exactly with their
log-sum-exp statistics, which is how local noisy keys, gathered clean keys and ring chunks meet.

Shapes follow Megatron's core attention: q [sq, b, H, d], k/v [sk, b, G, d] with G | H (GQA);
outputs [sq, b, H, d] and lse [b, H, sq] in fp32.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

# Masked scores are set to a large finite negative number rather than -inf: a query with no
# allowed key in one partial then gets a finite lse that the merge weights by exactly 0, and no
# NaN can appear in forward or backward.
MASKED_SCORE = -1.0e30


def math_partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, softmax_scale: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Explicit fp32 attention (CPU or any device), differentiable in q, k, v and the lse."""
    sq, b, H, d = q.shape
    sk, G = k.shape[0], k.shape[2]
    rep = H // G
    dtype = q.dtype
    # [b, G, rep, sq, d] x [b, G, sk, d] -> [b, G, rep, sq, sk]
    qg = q.float().permute(1, 2, 0, 3).reshape(b, G, rep, sq, d)
    kg = k.float().permute(1, 2, 0, 3)
    vg = v.float().permute(1, 2, 0, 3)
    scores = torch.einsum("bgrqd,bgkd->bgrqk", qg, kg) * softmax_scale
    scores = scores.masked_fill(~allowed.to(scores.device), MASKED_SCORE)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bgrqk,bgkd->bgrqd", probs, vg)
    out = out.reshape(b, H, sq, d).permute(2, 0, 1, 3).to(dtype)
    return out, lse.reshape(b, H, sq)


def merge_partials(partials: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact combination of partial attentions over disjoint key sets, in fp32."""
    if len(partials) == 1:
        return partials[0]
    outs = torch.stack([o.float() for o, _ in partials])  # [n, sq, b, H, d]
    lses = torch.stack([l for _, l in partials])  # [n, b, H, sq]
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse).permute(0, 3, 1, 2).unsqueeze(-1)  # [n, sq, b, H, 1]
    out = (weights * outs).sum(0).to(partials[0][0].dtype)
    return out, lse


def flex_partial_attention(q, k, v, mask, softmax_scale):
    """FlexAttention driven by the mask's row vectors (`attention/flex.py`; default on CUDA)."""
    from megatron_csbp.attention.flex import flex_attention_partial

    return flex_attention_partial(q, k, v, mask, softmax_scale)


def flash_partial_attention(q, k, v, mask, softmax_scale):
    """flash-attn varlen for the pieces it expresses exactly, flex for the rest (`attention/flash.py`)."""
    from megatron_csbp.attention.flash import flash_attention_partial

    return flash_attention_partial(q, k, v, mask, softmax_scale)


KERNELS = {"math": math_partial_attention, "flex": flex_partial_attention, "flash": flash_partial_attention}


def get_kernel(name: str, device: torch.device):
    """'auto' picks FlexAttention on CUDA and the explicit math kernel elsewhere."""
    if name == "auto":
        name = "flex" if device.type == "cuda" else "math"
    if name not in KERNELS:
        raise ValueError(f"--attention-kernel must be one of {sorted(KERNELS) + ['auto']}, got {name!r}")
    if name == "flash":  # fail at selection, with the flag's name, not inside the first forward
        from megatron_csbp.attention.flash import require_flash_attn

        require_flash_attn()
    return KERNELS[name]
