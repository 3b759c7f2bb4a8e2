"""Device relocation: megatron-core modules see a `torch` whose CUDA is the CPU.

A module is proxied by replacing its global `torch` (`proxy_modules`); `torch_view_for_module()`
gives the view to other code; `PROXIED` holds one name per module visited. What is relocated and
what is not pure relocation (memory statistics, RNG): docs/compat.md.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Callable

import torch

PROXIED: set = set()


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def _to_cpu_device(device):
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) or (
            isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    return device


def _nothing(*a, **k):
    pass


class _NoOp:
    """Stands in for torch.cuda.Stream / current_stream / default_stream and torch.cuda.Event."""

    __init__ = wait_stream = wait_event = synchronize = record = wait = _nothing

    def record_event(self, event=None):
        return event if event is not None else _NoOp()

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_STREAM = _NoOp()


class CpuCuda(types.ModuleType):
    """`torch.cuda` as seen by a proxied megatron module."""

    def __init__(self):
        super().__init__("torch.cuda(cpu-compat)")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    current_device = staticmethod(lambda: torch.device("cpu"))

    synchronize = empty_cache = reset_peak_memory_stats = staticmethod(_nothing)
    Stream = current_stream = default_stream = staticmethod(lambda *a, **k: _STREAM)  # Stream: torch.cuda.Stream
    Event = _NoOp

    stream = staticmethod(lambda *a, **k: contextlib.nullcontext())
    memory_allocated = max_memory_allocated = memory_reserved = max_memory_reserved = staticmethod(lambda *a, **k: 0)
    get_rng_state = staticmethod(lambda *a, **k: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *a, **k: torch.set_rng_state(state))
    manual_seed = manual_seed_all = staticmethod(lambda seed: torch.manual_seed(seed))


_CPU_CUDA = CpuCuda()


def _remap_device_kwarg(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class TorchProxy(types.ModuleType):
    """`torch` as seen by a proxied megatron module: CUDA devices become CPU; its `torch.cuda` is `cuda`."""

    def __init__(self, cuda: types.ModuleType):
        super().__init__("torch(cpu-compat)")
        self.cuda = cuda

    def __getattr__(self, name):  # (a name the proxy does not hold)
        value = getattr(torch, name)
        if isinstance(value, (types.BuiltinFunctionType, types.FunctionType)):
            value = self.__dict__[name] = _remap_device_kwarg(value)  # wrapped once: found there from now on
        return value


TORCH_PROXY = TorchProxy(_CPU_CUDA)


def torch_view_for_module():
    """What a megatron module should see as `torch` here: the CPU view when CUDA is absent (device
    factories and `torch.cuda.current_device()` give CPU), plain torch otherwise. For modules built
    outside the shim's list, e.g. megatron's GatedDeltaNet while constructing it."""
    return TORCH_PROXY if cuda_absent() else torch


def mentions_cuda(module) -> bool:
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return False
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
        return "cuda" in f.read()
    return False


def proxy_modules(select: Callable[[str], bool], proxy: types.ModuleType = None) -> None:
    """Every loaded module whose name `select` accepts, that names CUDA and sees plain `torch`,
    gets `proxy` (default: the megatron-core view) as its global `torch`. Each module once."""
    proxy = TORCH_PROXY if proxy is None else proxy
    for name, module in list(sys.modules.items()):
        if module is None or name in PROXIED or not select(name):
            continue
        if getattr(module, "torch", None) is torch and mentions_cuda(module):
            module.torch = proxy
        PROXIED.add(name)

