"""Megatron's RNG tracker and recompute RNG hooks on the CPU generator.

`patch_rng` swaps in `CpuRNGStatesTracker` (Megatron's named-state semantics on the CPU
generator) and the CPU recompute get/set. Numerics: docs/compat.md#which-patches-change-numerics.
"""
from __future__ import annotations

import importlib

import torch


def _make_cpu_tracker_class(random_mod):
    class CpuRNGStatesTracker(random_mod.CudaRNGStatesTracker):
        """Megatron's RNG tracker on the CPU generator: megatron-core's own named states, `add` and
        `fork`, whose `torch.cuda` RNG calls reach the CPU generator through the module's CPU view of
        torch (`device.proxy_modules`) and whose state get/set are `patch_rng`'s. (fork's warning that
        the CPU state changed, always true here, stays below the ERROR level `cpu.py` sets.)"""

        def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
            if use_cudagraphable_rng:
                raise ValueError("CUDA-graph-safe RNG needs CUDA")
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

    CpuRNGStatesTracker.__cpu_compat__ = True
    return CpuRNGStatesTracker


def patch_rng() -> None:
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    if getattr(random_mod.CudaRNGStatesTracker, "__cpu_compat__", False):
        return

    # (device, clone, graph_safe: the CPU generator has one state)
    random_mod._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random_mod._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    random_mod.CudaRNGStatesTracker = _make_cpu_tracker_class(random_mod)
    tracker = random_mod._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not getattr(type(tracker), "__cpu_compat__", False):
        random_mod.initialize_rng_tracker(force_reset=True)

