"""The compat entry point: library fixes on every device, device relocation only without CUDA.

`install_cpu_compat()` (also named `install_compat`) first installs the fixes for what
megatron-core runs without, TE and apex (`compat.libraries`: torch norms under sequence
parallelism, MoE's `te_general_gemm`, torch Adam's state), on every device: a GPU without TE or
apex needs them as much as a CPU. Then, only when CUDA is absent (or `force`), the device
relocation that runs megatron-core 0.16.1 on CPU gloo ranks, one module per mechanism, in this
order: the device proxy (`compat.device`), the RNG tracker (`compat.rng`), the optimizer's CUDA
type names (`compat.optimizer.patch_cpu_optimizers`), MoE's all-to-all split sizes over gloo
(`compat.moe.patch_moe`), the pipeline's tied embedding and sent outputs (`compat.pipeline`).
It returns whether the relocation is active. Which patches change numerics: the
`megatron_csbp.compat` package docstring and docs/compat.md. It is idempotent: a second call only
extends the device remap to megatron modules imported since the first call.

The table lists every patched call site; the last column's layer is "library" (every device,
keyed on the missing library) or "device" (without CUDA only).

| component (megatron.core 0.16.1) | what breaks | what the shim does (layer) |
|---|---|---|
| `tensor_parallel.random` tracker (`add`, `fork`), `model_parallel_cuda_manual_seed`, checkpoint recompute (`_get/_set_cuda_rng_state`) | reads/writes `torch.cuda` RNG state (a lazy no-op or an error without CUDA: recompute would silently replay other random numbers) | `CpuRNGStatesTracker` (a `CudaRNGStatesTracker` subclass) keeps named states of the CPU generator; the module-level RNG get/set use `torch.get/set_rng_state`; `torch.cuda.manual_seed` there seeds the CPU generator (device) |
| rotary embedding, router, global memory buffer, mappings, DDP buffers, schedules, optimizers, clip grads, `dist_checkpointing` (every module that names CUDA) | `device="cuda"` / `torch.cuda.current_device()` factories, `torch.cuda.Stream/stream/Event/synchronize/empty_cache` | the module's global `torch` becomes a proxy: factory calls with a CUDA `device` get `cpu`, `torch.cuda.current_device()` is `cpu`, streams/events are no-op objects, `synchronize`/`empty_cache` do nothing, memory statistics read 0 (device) |
| `clip_grad_by_total_norm_fp32` | asserts `grad.type() == 'torch.cuda.FloatTensor'` | runs with CPU tensors reporting `torch.cuda.*` type names (fp32 clip by total norm, unchanged) (device) |
| `Float16OptimizerWithFloat16Params`, `DistributedOptimizer` | dispatch on `param.type()` being `torch.cuda.*Tensor` | same type-name view during their construction (device) |
| `DistributedOptimizer._set_main_param_and_optimizer_states` with torch Adam (no TE/Apex) | fully-reshardable load skips the per-param `step` (restored from param groups) then copies it: KeyError | copy the keys present (library: torch Adam) |
| `DistributedOptimizer.state_dict` with torch Adam, before the first step | asserts one per-param `step` value; none exist yet (loading into a fresh run) | create torch Adam's first-step state (zeros, step 0) first (library: torch Adam) |
| `DistributedOptimizer.load_state_dict` with torch Adam | one shared `step` tensor for all parameters, incremented in place once per parameter: resumed runs use wrong bias corrections (silent) | each state gets its own copy (library: torch Adam) |
| `DistributedOptimizer.get_parameter_state_dp_zero` (checkpointing, `fully_reshardable`) | non-gloo branch calls `send_tensor.cuda()` | always the gloo branch (on CPU the data-parallel group is gloo anyway) (device) |
| `transformer.moe.moe_utils` without TransformerEngine | `te_general_gemm` is never defined: NameError in the router GEMM | defined as `None` (the code's own non-TE path) (library: TE absent) |
| MoE all-to-all dispatcher | `torch.cuda.Stream()` side stream; split sizes passed as tensors/arrays, which gloo's `all_to_all_single` rejects | streams through the proxy (one no-op stream, so no side-stream bookkeeping); `_AllToAll` converts split sizes to lists (device) |
| `LanguageModule.setup_embeddings_and_output_layer` (PP > 1, tied embeddings) | `weight.data.cuda()` before the embedding group's all-reduce | runs with `Tensor.cuda` the identity (`compat.pipeline`; same all-reduce) (device) |
| `pipeline_parallel.schedules.deallocate_output_tensor` (Megatron-LM sets `deallocate_pipeline_outputs`) | the interleaved schedule's overlapped P2P posts a gloo `isend` and swaps the output's `.data` at once: the send reads freed storage (the next stage receives other numbers, run to run) | still swaps `.data`, but keeps the old storage referenced from the output until its backward (`compat.pipeline`) (device) |
| `WrappedTorchNorm` with `--sequence-parallel` | asserts "sequence parallel not supported by torch LayerNorm" | builds the norm without the assert and tags its parameters `sequence_parallel=True`, so `finalize_model_grads` all-reduces their gradients over TP exactly as for TE norms (library: torch norm) |

Proxied modules are those already imported when the shim runs (it imports the ones training,
checkpointing and MoE need first); call it again after importing more of megatron-core.
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
