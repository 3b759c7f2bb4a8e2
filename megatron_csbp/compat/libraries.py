"""Fixes for what megatron-core runs without: TransformerEngine, apex. Installed on every device.

Each fix is keyed on the missing library or the fallback megatron-core takes without it, never on
the device (table: docs/compat.md#library-fixes-every-device).
"""
from __future__ import annotations

from megatron_csbp.compat import moe, norms, optimizer


def install_library_fixes() -> None:
    """Install every fix above (idempotent; each acts only where its library is missing)."""
    norms.patch_torch_norm()
    moe.patch_te_general_gemm()
    optimizer.patch_torch_adam()
    optimizer.patch_mixed_dtype_groups()
