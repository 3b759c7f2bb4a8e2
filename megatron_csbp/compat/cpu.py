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

# Modules whose CUDA call sites training, checkpointing and MoE reach; imported before patching.
_EAGER_MODULES = (
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.data",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.torch_norm",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.ssm.gated_delta_net",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.core",
    "megatron.core.dist_checkpointing.mapping",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.serialization",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
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
    device.proxy_loaded_modules()
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
