"""Fixes for what megatron-core runs without: TransformerEngine, apex. Installed on every device.

Each fix is keyed on the missing library or on the fallback megatron-core takes without it,
never on the device: a GPU without TE or apex takes the same fallbacks as a CPU.

| fix | keyed on | what breaks without it |
|---|---|---|
| `compat.norms.patch_torch_norm` | megatron-core's torch norm (`WrappedTorchNorm`) being built: TE absent, or the local spec, which the trainer always uses | `--sequence-parallel` asserts "sequence parallel not supported by torch LayerNorm" (the trainer requires SP for MoE with TP) |
| `compat.moe.patch_te_general_gemm` | TE absent (`moe_utils` never defined `te_general_gemm`) | MoE's router GEMM raises `NameError: te_general_gemm` |
| `compat.optimizer.patch_torch_adam` | the distributed optimizer's inner optimizer being torch Adam/AdamW (TE's and apex's fused Adam absent) | a resumed run uses wrong bias corrections (one shared `step` tensor); a save before the first step asserts; a fully-reshardable load raises KeyError 'step' |

Device relocation (CUDA names on a CPU) is a separate layer, installed only without CUDA:
`compat.cpu.install_cpu_compat`, which also installs these.
"""
from __future__ import annotations

from megatron_csbp.compat import moe, norms, optimizer


def install_library_fixes() -> None:
    """Install every fix above (idempotent; each acts only where its library is missing)."""
    norms.patch_torch_norm()
    moe.patch_te_general_gemm()
    optimizer.patch_torch_adam()
