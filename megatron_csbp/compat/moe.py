"""megatron-core MoE without TransformerEngine (every device), and over gloo (CPU).

`patch_te_general_gemm` (library fix, every device) and `patch_moe` (device relocation, CPU
only); what each fixes and why numerics are unchanged: docs/compat.md.
"""
from __future__ import annotations

import importlib

from megatron_csbp.compat import replace_once


def _as_split_list(sizes):
    """gloo's all_to_all takes the split sizes as a list of ints (a tensor's or tuple's elements)."""
    return None if sizes is None else [int(x) for x in sizes]


def patch_te_general_gemm() -> None:
    """TE absent: megatron-core's moe_utils names `te_general_gemm` without defining it."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if "te_general_gemm" not in moe_utils.__dict__:
        moe_utils.te_general_gemm = None


def patch_moe() -> None:
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")

    def make(orig_forward):
        def forward(ctx, group, input, output_split_sizes, input_split_sizes, *more):
            # more: later arguments passed on as given (megatron-core 0.19 adds `use_nccl_stream`)
            return orig_forward(ctx, group, input, _as_split_list(output_split_sizes),
                                _as_split_list(input_split_sizes), *more)
        return forward

    replace_once(mappings._AllToAll, "forward", make, static=True)
