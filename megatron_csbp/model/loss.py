"""The block-diffusion loss: sum(w * CE over target rows) / denominator with Megatron's
vocab-parallel cross entropy, the absorbing mask token optionally left out of the softmax.

`BlockDiffusionModel.loss` calls `weighted_cross_entropy` with the objective's mask token when the
objective excludes it (`Objective.exclude_mask_from_softmax`); the DFlash drafter's loss is its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core import parallel_state as mpu

from megatron_csbp.utils.precision import at_least_fp32, vocab_parallel_cross_entropy


@dataclass
class LossOutput:
    loss: torch.Tensor  # this rank's partial loss (already divided by the global denominator)
    num_targets: torch.Tensor  # target rows on this rank
    weighted_sum: torch.Tensor  # sum of w * CE on this rank (before the division)


def weighted_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                           denominator: torch.Tensor, exclude_token: Optional[int] = None) -> LossOutput:
    """sum over target rows (targets >= 0) of w * CE / denominator with Megatron's vocab-parallel
    cross entropy (logits [b, s, V/TP], this rank's vocabulary shard; TP = 1 too).

    `exclude_token` (the absorbing mask token of BD3-LM) is removed from the softmax: its logit is
    -inf on the shard that holds it. Rows that are no target get a placeholder target that is never
    that column (CE of a row whose target logit is -inf is +inf, and +inf x 0 = NaN), and their CE
    is dropped with `where`, not multiplied by 0. A target equal to `exclude_token` is refused: its
    probability is 0 by construction (objectives never make the mask token a target).
    """
    logits_f = at_least_fp32(logits)
    is_target = targets >= 0
    placeholder = 0
    if exclude_token is not None:
        if bool((targets == exclude_token).any()):
            raise ValueError(f"a target equals the mask token {exclude_token}, which is excluded from the softmax: "
                             "the objective must never make the mask token a target")
        logits_f = exclude_from_softmax(logits_f, exclude_token)
        placeholder = 1 if exclude_token == 0 else 0
    safe_targets = torch.where(is_target, targets, torch.full_like(targets, placeholder))
    # Megatron's vocab-parallel CE wants [s, b, V/TP] (works for TP = 1 too) and rewrites its
    # input in place: never hand it a view of the model's own logits.
    logits_sb = logits_f.transpose(0, 1)
    logits_sb = (logits_sb.clone(memory_format=torch.contiguous_format) if logits_sb.data_ptr() == logits.data_ptr()
                 else logits_sb.contiguous())
    ce = vocab_parallel_cross_entropy(logits_sb, safe_targets.transpose(0, 1).contiguous()).transpose(0, 1)
    weighted = torch.where(is_target, ce * weights, torch.zeros_like(ce)).sum()
    # A rank whose rows hold no target still returns a loss attached to every parameter.
    loss = weighted / denominator + 0.0 * logits.sum()
    return LossOutput(loss, is_target.sum(), weighted.detach())


def exclude_from_softmax(logits_f: torch.Tensor, token_id: int) -> torch.Tensor:
    """-inf at `token_id` on the tensor-parallel rank whose vocabulary shard holds it."""
    local_vocab = logits_f.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * local_vocab if mpu.model_parallel_is_initialized() else 0
    if start <= token_id < start + local_vocab:
        logits_f = logits_f.index_fill(-1, torch.tensor([token_id - start], device=logits_f.device), float("-inf"))
    return logits_f
