"""Megatron-LM's exit conditions (`--exit-signal-handler`, `--exit-duration-in-mins`,
`--exit-interval`), checked at the end of every iteration as Megatron-LM's
`checkpoint_and_decide_exit` checks them: each saves a checkpoint and ends the run with status 0,
all ranks agreeing in one MAX all-reduce; `Interruptible`: Ctrl-C without the handler, one line.
Behaviour under Slurm, torchrun and a terminal:
docs/training.md#preemption-sigterm-ctrl-c-time-limits-requeued-jobs.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from megatron_csbp.training.metrics import allreduce
from megatron_csbp.utils.cli import CliError, Interrupted

#: the program's start for --exit-duration-in-mins (Megatron-LM: `_TRAIN_START_TIME`, set when
#: megatron/training/training.py is imported; here the import of this module by the trainer)
PROGRAM_START = time.time()


def exit_signals(name: str = "SIGTERM") -> tuple:
    """The signals `--exit-signal-handler` notes: Megatron-LM's `--exit-signal` (default SIGTERM) and
    SIGINT, a terminal's Ctrl-C (torchrun passes it on to the ranks)."""
    return tuple(dict.fromkeys((signal.Signals[name], signal.SIGINT)))


class ExitSignal:
    """Context manager: while active, each of `sigs` sets a flag instead of ending the process. Once
    a signal arrived, leaving the context keeps the flag-setting handlers (the run is on its way out:
    a repeated signal must not kill it)."""

    def __init__(self, sigs=exit_signals()):
        self.sigs, self._received, self._previous = tuple(sigs), None, {}

    def __enter__(self) -> "ExitSignal":
        self._received = None
        for sig in self.sigs:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self._received = self._received or signum

    def __exit__(self, *exc) -> None:
        if not self._received:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    @property
    def name(self) -> str:
        """The signal received (the first one), else the first noted."""
        return signal.Signals(self._received or self.sigs[0]).name

    @property
    def noted(self) -> bool:
        """Whether this rank got the signal (local, no communication)."""
        return bool(self._received)


class Interruptible:
    """Context manager for a run without --exit-signal-handler: SIGINT (Ctrl-C; torchrun passes it
    on) ends it with one line (`Interrupted`, exit status 130) saying where the run was and what is
    lost, whatever the ranks were doing when it came (a peer that left first breaks a collective)."""

    trainer = None

    def __enter__(self) -> "Interruptible":
        self._got, self._previous = False, None
        if threading.current_thread() is threading.main_thread():  # (Python's rule for handlers)
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self._got = True
        raise KeyboardInterrupt

    def __exit__(self, kind, exc, tb) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if not self._got or kind is None or issubclass(kind, CliError):
            return
        t = self.trainer
        where = f" after iteration {t.iteration}" if t is not None and getattr(t, "iteration", None) else ""
        saved = (f"the latest checkpoint is iteration {t.last_saved}" if t is not None and t.last_saved is not None
                 else "nothing was saved")
        raise Interrupted(f"interrupted by SIGINT{where}: {saved}, the work since is lost (--exit-signal-handler "
                          "with --save saves the iteration reached on SIGINT or SIGTERM and exits 0)") from None


@dataclass
class ExitConditions:
    """`--exit-signal-handler`, `--exit-duration-in-mins`, `--exit-interval` (Megatron-LM's order)."""
    exit_signal: Optional[ExitSignal]
    exit_duration_in_mins: Optional[float]
    exit_interval: Optional[int]
    start: float = PROGRAM_START

    def check(self, iteration: int) -> Optional[str]:
        """Why the run stops after `iteration` (one line), or None. Collective when the signal
        handler or the duration is on (the same verdict on every rank)."""
        flags = []
        if self.exit_signal is not None:
            flags.append(self.exit_signal.noted)
        minutes = (time.time() - self.start) / 60.0
        if self.exit_duration_in_mins:
            flags.append(minutes > self.exit_duration_in_mins)
        # collective: each flag OR-ed over every rank (one all-reduce)
        agreed = allreduce([float(f) for f in flags], op=dist.ReduceOp.MAX) if flags else []
        if self.exit_signal is not None and agreed.pop(0):
            return f"received {self.exit_signal.name} (--exit-signal-handler): exiting after iteration {iteration}"
        if self.exit_duration_in_mins and agreed.pop(0):
            return (f"--exit-duration-in-mins {self.exit_duration_in_mins:g}: {minutes:.2f} minutes since the "
                    f"start; exiting after iteration {iteration}")
        if self.exit_interval and iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval}: exiting after iteration {iteration}"
        return None
