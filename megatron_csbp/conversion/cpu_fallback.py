"""CPU support for the converter's own Megatron calls.

Uses the project's shim (`megatron_csbp.compat.cpu.install_cpu_compat`) when it is present. Until
it lands, applies the minimum the converter needs on a machine without CUDA (see
/work/shared/docs/megatron-notes.md, "CUDA-only call sites"):

- `dist_checkpointing` save calls `torch.cuda.synchronize()` -> no-op;
- the MoE router moves its weight to `torch.cuda.current_device()` -> the CPU;
- megatron-core 0.16.1 MoE utils reference `te_general_gemm` without Transformer Engine -> None.

Nothing is patched when CUDA is available.
"""
from __future__ import annotations

import torch

_DONE = False


def ensure_cpu_compat() -> str:
    """Make Megatron's CUDA-only call sites usable on CPU. Returns which path was taken."""
    global _DONE
    if torch.cuda.is_available():
        return "cuda"
    try:
        from megatron_csbp.compat.cpu import install_cpu_compat  # the project's shim
    except ImportError:
        install_cpu_compat = None
    if install_cpu_compat is not None:
        install_cpu_compat()
        return "shim"
    if not _DONE:
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: torch.device("cpu")
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        _DONE = True
    return "fallback"
