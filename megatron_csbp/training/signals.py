"""`--exit-signal-handler` (Megatron-LM's flag and behaviour): SIGTERM (what SLURM and most
schedulers send before they kill a job) is noted, the current iteration finishes, a checkpoint is
saved (with `--save`) and the run exits with status 0; `--load` of the same folder resumes it.

The note is agreed across ranks at the end of every iteration (one all-reduce of one number, as
Megatron-LM's `DistributedSignalHandler` all-gathers one flag), so every rank stops after the same
iteration even when the signal reached only some of them.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class ExitSignal:
    """Context manager: while active, `sig` sets a flag instead of ending the process."""

    def __init__(self, sig: signal.Signals = signal.SIGTERM):
        self.sig = sig
        self._received = False
        self._previous = None

    def __enter__(self) -> "ExitSignal":
        self._received = False
        self._previous = signal.getsignal(self.sig)
        signal.signal(self.sig, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self._received = True

    def __exit__(self, *exc) -> None:
        signal.signal(self.sig, self._previous if self._previous is not None else signal.SIG_DFL)

    @property
    def name(self) -> str:
        return signal.Signals(self.sig).name

    def received(self) -> bool:
        """Collective: whether any rank got the signal."""
        flag = torch.tensor([1.0 if self._received else 0.0],
                            device=torch.cuda.current_device() if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
