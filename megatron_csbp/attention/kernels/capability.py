"""Which attention kernel runs which head dim, dtype and device, forward and backward, and the
kernel a layer gets: `choose(name, device, head_dim, dtype)`, one logged line per distinct choice.
The table, its sources and what has run where: docs/attention-kernels.md#capabilities.
"""
from __future__ import annotations

import sys

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

ANY = None
_HALF = (torch.float16, torch.bfloat16)
_ALL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: FlexAttention's backward templates need this much shared memory a block past head dim 128
#: (parts with ~100 KB fail there; Hopper's 227 KB does not)
FLEX_WIDE_BWD_SMEM = 160 * 1024


@dataclass(frozen=True)
class Capability:
    devices: Tuple[str, ...]
    dtypes: Tuple[torch.dtype, ...]
    max_head_dim_fwd: Optional[int]  # None: any
    max_head_dim_bwd: Optional[int]  # None: any; 0: no backward

    def refuses(self, device: torch.device, head_dim: int, dtype: torch.dtype, backward: bool) -> Optional[str]:
        """Why the kernel cannot run this call, or None."""
        if device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)} only, not {device.type}"
        if dtype not in self.dtypes:
            return f"takes {', '.join(str(d).split('.')[-1] for d in self.dtypes)}, not {str(dtype).split('.')[-1]}"
        limit = self.max_head_dim_bwd if backward else self.max_head_dim_fwd
        if limit == 0:
            return f"has no backward on {device.type}"
        if limit is not None and head_dim > limit:
            return f"runs head dims up to {limit} {'with' if backward else 'without'} backward, not {head_dim}"
        return None


def _flex_cuda_bwd_limit(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 0
    return 256 if smem >= FLEX_WIDE_BWD_SMEM else 128


def capabilities(name: str, device: torch.device) -> Tuple[Capability, ...]:
    """The kernel's capability rows (one per device type it runs on)."""
    if name == "flex":
        bwd = _flex_cuda_bwd_limit(device) if device.type == "cuda" else 0
        return (Capability(("cuda",), _ALL, 256, bwd if device.type == "cuda" else 256),
                Capability(("cpu",), _ALL, ANY, 0))  # eager on CPU: torch has no CPU Flex backward
    if name == "flash":  # flash-attn's varlen kernels (and flex for the rest)
        return (Capability(("cuda",), _HALF, 256, min(256, _flex_cuda_bwd_limit(device)) if device.type == "cuda" else 256),)
    if name == "cpu_flash":
        return (Capability(("cpu",), _ALL, ANY, ANY),)
    return (Capability(("cpu", "cuda"), _ALL, ANY, ANY),)  # tiled, math: torch ops on any device


def refuses(name: str, device: torch.device, head_dim: int, dtype: torch.dtype, backward: bool) -> Optional[str]:
    rows = capabilities(name, device)
    return next((c for c in rows if device.type in c.devices), rows[0]).refuses(device, head_dim, dtype, backward)


#: 'auto' on each device: the fastest kernel first, the tiled kernel (any head dim) last
PREFERENCE = {"cuda": ("flex", "tiled"), "cpu": ("cpu_flash", "tiled")}
_LOGGED = set()
#: where the choice lines go: stdout, beside a run's other " > " lines, unless the app's stdout is its
#: output (generate's text, dflash evaluate's JSON): those call `info_to_stderr` first
_TO_STDERR = False


def info_to_stderr() -> None:
    global _TO_STDERR
    _TO_STDERR = True  # a flag, not the stream: sys.stderr is looked up when printing (it may be replaced)


def choose(name: str, device: torch.device, head_dim: int, dtype: torch.dtype, backward: bool = True) -> str:
    """The kernel for one layer's call: `name` itself (refused with the flag's name when it cannot run
    the call), or for 'auto' the first of PREFERENCE that can. Logs one line per distinct choice."""
    if name == "auto":
        for candidate in PREFERENCE.get(device.type, ("tiled",)):
            why = refuses(candidate, device, head_dim, dtype, backward)
            if why is None:
                break
            _log(f"attention kernel: {candidate} {why}; next choice")
        chosen = candidate
    else:
        why = refuses(name, device, head_dim, dtype, backward)
        if why is not None:
            raise ValueError(f"--attention-kernel {name} {why} (head dim {head_dim}, {str(dtype).split('.')[-1]}, "
                             f"{device.type}): use --attention-kernel auto or tiled")
        chosen = name
    _log(f"attention kernel: {chosen} for head dim {head_dim}, {str(dtype).split('.')[-1]}, {device.type}"
         f"{' with backward' if backward else ''} (--attention-kernel {name})")
    return chosen


def _log(line: str) -> None:
    from megatron_csbp.utils.cli import rank

    if line not in _LOGGED:
        _LOGGED.add(line)
        if rank() in (None, 0):  # an information line on stdout, like the run's other " > " lines
            print(f" > {line}", file=sys.stderr if _TO_STDERR else sys.stdout, flush=True)
