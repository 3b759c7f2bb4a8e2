"""Partial attention kernels that return the log-sum-exp, and the fp32 merge of partials.

Every kernel is `kernel(q, k, v, mask: PartialMask, softmax_scale) -> (out, lse)`: q [sq, b, H, d],
k/v [sk, b, G, d] with G | H (GQA); out [sq, b, H, d], lse [b, H, sq] in fp32 (fp64 for fp64
inputs); a query with no allowed key gets output 0 and lse = MASKED_SCORE. Kernels "cpu_flash"
(default on CPU), "tiled", "flex" (default on CUDA), "flash", "math" (the dense small-case
reference): docs/attention-kernels.md.
"""
from __future__ import annotations

from typing import Tuple

import torch

from megatron_csbp.attention.merge import PartialMerge, merge_partials
from megatron_csbp.attention.kernels.cpu_flash import cpu_flash_partial_attention
# FlexAttention driven by the mask's row vectors (default on CUDA); flash-attn varlen for the pieces
# it expresses exactly, flex for the rest
from megatron_csbp.attention.kernels.flash import flash_attention_partial as flash_partial_attention, require_flash_attn
from megatron_csbp.attention.kernels.flex import flex_attention_partial as flex_partial_attention
from megatron_csbp.attention.kernels.tiled import MASKED_SCORE, tiled_partial_attention
from megatron_csbp.layout.rows import PartialMask
from megatron_csbp.utils.precision import compute_dtype

__all__ = ["MASKED_SCORE", "KERNELS", "get_kernel", "math_partial_attention", "merge_partials", "PartialMerge",
           "tiled_partial_attention", "flex_partial_attention"]


def math_partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: PartialMask, softmax_scale: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Explicit attention in fp32 (fp64 for fp64 inputs) on any device, differentiable in q, k, v
    and the lse. Reference for small cases: holds [b, H, sq, sk] scores and the dense mask."""
    sq, b, H, d = q.shape
    sk, G = k.shape[0], k.shape[2]
    if mask.shape != (sq, sk):
        raise ValueError(f"mask covers {mask.shape} (queries, keys), attention got {(sq, sk)}")
    rep = H // G
    dtype, cdt = q.dtype, compute_dtype(q.dtype)
    allowed = mask.dense().to(q.device)
    # [b, G, rep, sq, d] x [b, G, sk, d] -> [b, G, rep, sq, sk]
    qg = q.to(cdt).permute(1, 2, 0, 3).reshape(b, G, rep, sq, d)
    kg = k.to(cdt).permute(1, 2, 0, 3)
    vg = v.to(cdt).permute(1, 2, 0, 3)
    scores = torch.einsum("bgrqd,bgkd->bgrqk", qg, kg) * softmax_scale
    scores = scores.masked_fill(~allowed, MASKED_SCORE)
    # A row with no allowed key: lse = MASKED_SCORE + log(sk), which rounds to MASKED_SCORE, and
    # its probabilities are zeroed (output 0), as the tiled kernel does.
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).masked_fill(~allowed, 0.0)
    out = torch.einsum("bgrqk,bgkd->bgrqd", probs, vg)
    out = out.reshape(b, H, sq, d).permute(2, 0, 1, 3).to(dtype)
    return out, lse.reshape(b, H, sq)


KERNELS = {"math": math_partial_attention, "tiled": tiled_partial_attention, "flex": flex_partial_attention,
           "flash": flash_partial_attention, "cpu_flash": cpu_flash_partial_attention}


def get_kernel(name: str, device: torch.device):
    """'auto' picks FlexAttention on CUDA and the flash pieces on CPU (`cpu_flash`, 2.3-2.5x the
    tiled kernel's rate on the one-rank mask: docs/benchmarks/kernel_rate.md)."""
    if name == "auto":
        name = "flex" if device.type == "cuda" else "cpu_flash"
    if name not in KERNELS:
        raise ValueError(f"--attention-kernel must be one of {sorted(KERNELS) + ['auto']}, got {name!r}")
    if name == "flash":  # fail at selection, with the flag's name, not inside the first forward
        require_flash_attn()
    return KERNELS[name]
