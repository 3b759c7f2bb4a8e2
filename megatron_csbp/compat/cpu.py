"""The compat entry point: library fixes on every device, device relocation only without CUDA.

`install_cpu_compat()` (also `install_compat`) returns whether the relocation is active; it is
idempotent. Patched call sites (docs/compat.md#every-patched-call-site has the table: what breaks,
what the shim does, which layer): the `tensor_parallel.random` tracker,
`model_parallel_cuda_manual_seed` and recompute RNG; every module naming CUDA (rotary, router,
mappings, DDP, schedules, optimizers, `dist_checkpointing`); `clip_grad_by_total_norm_fp32`;
`Float16OptimizerWithFloat16Params` and `DistributedOptimizer` (type names, torch Adam state,
DP-zero gather, checkpoint state of groups mixing fp32 and 16-bit params); the loss scale's load; MoE's `te_general_gemm` and all-to-all; the pipeline's tied embedding and sent
outputs; `WrappedTorchNorm` under sequence parallelism.
"""
from __future__ import annotations

import importlib
import logging

from megatron_csbp.compat import device, libraries, moe, optimizer, pipeline, rng
from megatron_csbp.compat.device import cuda_absent

_INSTALLED = False

def _under(package: str, *names: str) -> tuple:
    return tuple(f"megatron.core.{package}{name}" for name in names)


# Modules whose CUDA call sites training, checkpointing and MoE reach; imported before patching.
_EAGER_MODULES = (
    "megatron.core.utils",
    *_under("tensor_parallel.", "random", "layers", "mappings", "cross_entropy", "data"),
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.torch_norm",
    *_under("transformer.moe.", "router", "moe_utils", "token_dispatcher", "experts", "moe_layer"),
    "megatron.core.ssm.gated_delta_net",
    *_under("distributed.", "param_and_grad_buffer", "distributed_data_parallel", "finalize_model_grads"),
    *_under("optimizer", "", ".optimizer", ".distrib_optimizer", ".clip_grads", ".grad_scaler"),
    "megatron.core.optimizer_param_scheduler",
    *_under("pipeline_parallel.", "schedules", "p2p_communication"),
    "megatron.core.models.common.language_module.language_module",
    *_under("dist_checkpointing", "", ".core", ".mapping", ".exchange_utils", ".serialization",
            ".tensor_aware_state_dict"),
    *_under("dist_checkpointing.strategies.", "torch", "filesystem_async", "state_dict_saver", "fully_parallel",
            "async_utils"),
)


def install_cpu_compat(force: bool = False) -> bool:
    """The library fixes (every device), then the device relocation when CUDA is absent (or
    `force`). Returns whether the relocation is active."""
    global _INSTALLED
    libraries.install_library_fixes()
    if not force and not cuda_absent():
        return False
    # Silence megatron's one-per-module "TE/Apex not installed" warnings on CPU.
    logging.getLogger("megatron.core").setLevel(max(logging.getLogger("megatron.core").level, logging.ERROR))
    for name in _EAGER_MODULES:
        importlib.import_module(name)
    device.proxy_modules(lambda name: name.startswith("megatron.core"))  # every one loaded so far
    if not _INSTALLED:
        rng.patch_rng()
        optimizer.patch_cpu_optimizers()
        moe.patch_moe()
        pipeline.patch_embedding_tie()
        pipeline.patch_output_deallocation()
        _INSTALLED = True
    return True


install_compat = install_cpu_compat  # the name says what it does on every device


def is_installed() -> bool:
    """Whether the device relocation (the CPU layer) is installed."""
    return _INSTALLED
