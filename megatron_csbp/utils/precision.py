"""The precision reductions, softmaxes and norms run in: at least fp32.

fp32 for bf16/fp16/fp32 inputs (unchanged from computing in `.float()`), fp64 for fp64 inputs, so
a model built with `params_dtype=torch.float64` is float64 end to end. The layout-vs-one-rank
exactness tests rely on this: in fp64 their tolerances sit ~6 orders of magnitude above the
rounding instead of at the last digit of one CPU's fp32 rounding.
"""
from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """max(fp32, dtype) for floating dtypes."""
    return torch.promote_types(dtype, torch.float32)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in `compute_dtype(x.dtype)` (no copy when it already is)."""
    return x.to(compute_dtype(x.dtype))


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of vocabulary-parallel logits [s, b, V/TP] against `target` [s, b].

    bf16/fp16/fp32 logits go to Megatron's `tensor_parallel.vocab_parallel_cross_entropy`, which
    computes in fp32 (and rewrites its input in place). fp64 logits would be cast to fp32 there, so
    they take the same math here in fp64: max and sum of exp all-reduced over the TP group, the
    target's logit taken on the rank that holds it (Megatron's autograd all-reduce, identity
    backward, carries the gradients)."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if logits.dtype != torch.float64:
        return tensor_parallel.vocab_parallel_cross_entropy(logits, target)
    tp = mpu.get_tensor_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    width = logits.shape[-1]
    start = (mpu.get_tensor_model_parallel_rank() if tp > 1 else 0) * width
    m = logits.detach().max(dim=-1, keepdim=True).values
    if tp > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    shifted = logits - m
    sum_exp = shifted.exp().sum(dim=-1)
    local = target - start
    inside = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    if tp > 1:
        sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(sum_exp)
        picked = tensor_parallel.reduce_from_tensor_model_parallel_region(picked)
    return sum_exp.log() - picked
