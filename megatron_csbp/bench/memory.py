"""Peak memory of one training step on CPU, per rank.

CPU has no `torch.cuda.max_memory_allocated`, so two measures are taken, both per process:

- **tensor peak** (primary): the high-water mark of live tensor storage bytes during the step.
  At the start every tensor reachable from Python (weights, gradients, optimizer states, cached
  mask metadata) is counted once per storage; a `TorchDispatchMode` then sees every storage that
  an ATen op creates during forward, backward and the optimizer step (autograd-saved activations,
  gathered K/V, temporaries, collective buffers) and a weakref finalizer removes it when it is
  freed. This is the CPU analogue of `max_memory_allocated` (no allocator caching or
  fragmentation) and is deterministic.
- **RSS high-water** (secondary): `VmHWM` of the process after resetting it through
  `/proc/self/clear_refs` (Linux). It includes the interpreter, libraries and allocator slack.

The tracking mode slows the step down, so it is used on a separate, untimed step.
"""
from __future__ import annotations

import gc
import warnings
import weakref
from contextlib import suppress
from typing import Dict, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorPeakTracker(TorchDispatchMode):
    """Context manager: `peak_bytes` after exit is the live-tensor high-water mark inside it."""

    def __init__(self):
        super().__init__()
        self.live: Dict[int, int] = {}
        self.current = self.peak_bytes = self.baseline = 0

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.is_sparse:
            return
        try:
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):
            return
        if nbytes == 0 or key == 0 or key in self.live:
            return
        self.live[key] = nbytes
        self.current += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __enter__(self):
        # count every tensor reachable from Python now (the state the step starts from)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance on deprecated module proxies warns
            for obj in gc.get_objects():
                try:
                    if isinstance(obj, torch.Tensor):
                        self._add(obj)
                except ReferenceError:
                    continue
        self.baseline = self.current
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


def step_memory(step, group=None) -> Tuple[int, int, Optional[int]]:
    """(tensor peak, static tensors at its start, RSS high-water) of `step()`, after freeing earlier
    cases' reference cycles (models hold hooks) and a barrier of `group`."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier(group=group)
    with suppress(OSError), open("/proc/self/clear_refs", "w") as f:  # reset this process's peak RSS (Linux)
        f.write("5")
    with TensorPeakTracker() as tracker:
        step()
    return tracker.peak_bytes, tracker.baseline, rss_high_water_bytes()


def rss_high_water_bytes() -> Optional[int]:
    with suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    with suppress(Exception):  # no /proc: the process's peak RSS since its start
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
