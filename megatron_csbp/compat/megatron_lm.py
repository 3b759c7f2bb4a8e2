"""Run Megatron-LM's training loop (`megatron.training`, tags core_v0.16.1 and core_v0.19.0) on CPU ranks (gloo).

`install_megatron_lm_cpu_compat()`: a no-op with CUDA; otherwise megatron-core's shim plus the
Megatron-LM call sites of docs/compat.md#megatron-lms-training-loop-compatmegatron_lm (none
changes numerics). Call it after importing `megatron.training` and before `pretrain()`.
"""
from __future__ import annotations

import functools
import importlib

import torch

from megatron_csbp.compat import cpu as core_compat, device as device_view, replace_once, under
from megatron_csbp.compat.pipeline import itself

_INSTALLED = False
_PREFIXES = ("megatron.training", "megatron.legacy", "megatron.post_training", "megatron.rl")
_SCRIPTS = ("pretrain_gpt", "gpt_builders", "model_provider")

_EAGER_MODULES = ("megatron.training", *(f"megatron.training.{name}" for name in (
    "training", "initialize", "arguments", "utils", "checkpointing", "global_vars")))


class _TrainingCuda(device_view.CpuCuda):
    """`torch.cuda` as Megatron-LM's training package sees it on CPU: one device, the CPU."""

    device_count = staticmethod(lambda: 1)
    set_device = staticmethod(device_view._nothing)


_TRAINING_TORCH_PROXY = device_view.TorchProxy(_TrainingCuda())


def _patch_initialize() -> None:
    training = importlib.import_module("megatron.training.training")
    initialize = importlib.import_module("megatron.training.initialize")
    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)

    # (its arguments passed through: core_v0.19.0 passes tp_size)
    replace_once(initialize, "_warmup_jit_function", under(lambda: torch.random.fork_rng(devices=[])))
    fused_kernels = getattr(initialize, "fused_kernels", None)  # megatron.legacy's, imported by core_v0.16.1 only
    if fused_kernels is not None:
        fused_kernels.load = lambda args: None

    for name in ("megatron.training.utils", "megatron.training.arguments"):
        importlib.import_module(name).get_device_arch_version = lambda: 0


def install_megatron_lm_cpu_compat(force: bool = False) -> bool:
    """Install the Megatron-LM CPU shim when CUDA is absent (or `force`). Returns whether it is active."""
    global _INSTALLED
    if not force and not device_view.cuda_absent():
        return False
    core_compat.install_cpu_compat(force=force)
    for name in _EAGER_MODULES:
        importlib.import_module(name)
    core_compat.install_cpu_compat(force=force)  # megatron.core modules the training package imported
    device_view.proxy_modules(lambda name: name.startswith(_PREFIXES) or name in _SCRIPTS, _TRAINING_TORCH_PROXY)
    if not _INSTALLED:
        torch.Tensor.cuda = torch.nn.Module.cuda = itself
        _patch_initialize()
        _INSTALLED = True
    return True
