"""Run Megatron-LM's training loop (`megatron.training`, tags core_v0.16.1 and core_v0.19.0) on CPU ranks (gloo).

`install_megatron_lm_cpu_compat()` is a no-op when `torch.cuda.is_available()`. Without CUDA it
first installs megatron-core's shim (`megatron_csbp.compat.cpu`), then patches the Megatron-LM call
sites below. Each replaces a CUDA-only device, stream or query by its CPU equivalent, or takes
Megatron-LM's own no-CUDA branch; none changes numerics (the `_warmup_jit_function` patch keeps
the initial weights independent of CP; what the core shim changes: the `megatron_csbp.compat`
package docstring).

| call site (Megatron-LM core_v0.16.1; core_v0.19.0 where it differs) | what breaks on CPU | what the shim does |
|---|---|---|
| `pretrain()` -> `initialize_megatron()` | asserts "Megatron requires CUDA." | passes Megatron's own `allow_no_cuda=True` |
| `_initialize_distributed`, `_set_random_seed` | gate `mpu.initialize_model_parallel` and the model-parallel RNG seeding on `torch.cuda.device_count() > 0` | these modules see one device, the CPU: `device_count()` is 1, `set_device` does nothing (the rest as in the proxy below) |
| `_warmup_jit_function` (`set_jit_fusion_options`, in `pretrain()` before the model is built) | draws `torch.rand(..., device="cuda")` tensors shaped by --seq-length / CP: on GPU from the CUDA generator, on CPU from the CPU generator that --use-cpu-initialization weights come from, so the initial weights would depend on the CP size | runs with the CPU generator state saved and restored (`torch.random.fork_rng`), as the CUDA generator leaves it on GPU |
| `megatron.legacy.fused_kernels.load` (`_compile_dependencies`; core_v0.16.1 only: core_v0.19.0 has no megatron.legacy and builds no fused kernel) | reads the CUDA toolkit's `nvcc -V` (`CUDA_HOME` is None) | nothing to build without CUDA: a no-op |
| `get_device_arch_version()` (validate_args) | reads the GPU's compute capability | 0: no GPU architecture (so Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 rule for TP/CP > 1 applies, as before Blackwell) |
| `training.py`, `utils.py`, `checkpointing.py`, ... (every module that names CUDA) | `device='cuda'` factories, `torch.cuda.current_device()`, streams, `empty_cache`, memory statistics | the module's `torch` becomes compat/device.py's proxy (CUDA devices are the CPU, streams no-ops, memory statistics 0) |
| `get_model()` (`model_module.cuda(...)`), `evaluate()` and `get_batch_on_this_tp_rank` (`tensor.cuda()`) | `.cuda()` raises without CUDA | `torch.Tensor.cuda` and `torch.nn.Module.cuda` return the object unchanged on the CPU (without CUDA they can only raise, so nothing that worked changes) |

Call it after importing Megatron-LM's training package (`megatron.training`) and before `pretrain()`.
"""
from __future__ import annotations

import functools
import importlib

import torch

from megatron_csbp.compat import cpu as core_compat, device as device_view

_INSTALLED = False
_PREFIXES = ("megatron.training", "megatron.legacy", "megatron.post_training", "megatron.rl")
_SCRIPTS = ("pretrain_gpt", "gpt_builders", "model_provider")

_EAGER_MODULES = (
    "megatron.training",
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.arguments",
    "megatron.training.utils",
    "megatron.training.checkpointing",
    "megatron.training.global_vars",
)


class _TrainingCuda(device_view.CpuCuda):
    """`torch.cuda` as Megatron-LM's training package sees it on CPU: one device, the CPU."""

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def set_device(*a, **k):
        pass


class _TrainingTorchProxy(device_view.TorchProxy):
    def __getattr__(self, name):
        if name == "cuda":
            return _TRAINING_CUDA
        return super().__getattr__(name)


_TRAINING_CUDA = _TrainingCuda()
_TRAINING_TORCH_PROXY = _TrainingTorchProxy()


def _proxy_training_modules() -> None:
    device_view.proxy_modules(lambda name: name.startswith(_PREFIXES) or name in _SCRIPTS, _TRAINING_TORCH_PROXY)


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _module_cuda(self, device=None):
    return self


def _patch_initialize() -> None:
    training = importlib.import_module("megatron.training.training")
    initialize = importlib.import_module("megatron.training.initialize")
    original_init = initialize.initialize_megatron

    @functools.wraps(original_init)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    training.initialize_megatron = initialize_megatron

    warmup = initialize._warmup_jit_function

    @functools.wraps(warmup)
    def _warmup_jit_function(*args, **kwargs):  # core_v0.19.0 passes tp_size
        with torch.random.fork_rng(devices=[]):
            warmup(*args, **kwargs)

    initialize._warmup_jit_function = _warmup_jit_function
    fused_kernels = getattr(initialize, "fused_kernels", None)  # megatron.legacy's, imported by core_v0.16.1 only
    if fused_kernels is not None:
        fused_kernels.load = lambda args: None

    def get_device_arch_version():
        return 0

    for name in ("megatron.training.utils", "megatron.training.arguments"):
        importlib.import_module(name).get_device_arch_version = get_device_arch_version


def install_megatron_lm_cpu_compat(force: bool = False) -> bool:
    """Install the Megatron-LM CPU shim when CUDA is absent (or `force`). Returns whether it is active."""
    global _INSTALLED
    if not force and not device_view.cuda_absent():
        return False
    core_compat.install_cpu_compat(force=force)
    for name in _EAGER_MODULES:
        importlib.import_module(name)
    core_compat.install_cpu_compat(force=force)  # megatron.core modules the training package imported
    _proxy_training_modules()
    if not _INSTALLED:
        torch.Tensor.cuda = _tensor_cuda
        torch.nn.Module.cuda = _module_cuda
        _patch_initialize()
        _INSTALLED = True
    return True
