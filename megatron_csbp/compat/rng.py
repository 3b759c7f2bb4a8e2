"""Megatron's RNG tracker and recompute RNG hooks on the CPU generator.

`patch_rng` swaps in `CpuRNGStatesTracker` (Megatron's named-state semantics on the CPU
generator) and the CPU recompute get/set. Numerics: docs/compat.md#which-patches-change-numerics.
"""
from __future__ import annotations

import contextlib
import importlib

import torch


def _make_cpu_tracker_class(random_mod):
    base = random_mod.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """Megatron's RNG tracker on the CPU generator: named states, `add` and `fork` behave as
        on GPU (fork swaps the generator state in, runs, saves the advanced state, restores)."""

        def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
            if use_cudagraphable_rng:
                raise ValueError("CUDA-graph-safe RNG needs CUDA")
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception("seed {} already exists".format(seed))
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception("cuda rng state {} already exists".format(name))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.states_[name] = torch.get_rng_state()

        @contextlib.contextmanager
        def fork(self, name=random_mod._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception("cuda rng state {} is not added".format(name))
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(f"current state name {self._current_state_name} is not the same as "
                                    f"the desired state name {name}.")
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

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

