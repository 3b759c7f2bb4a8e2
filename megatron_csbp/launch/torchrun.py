"""`python -m megatron_csbp.launch.torchrun [torchrun options] -m megatron_csbp.train ...`: torch's own
torchrun (`torch.distributed.run.main`), except that with `--exit-signal-handler` among the arguments
a SIGTERM or SIGINT (Ctrl-C; and the job's `--exit-signal`) to the launcher is forwarded to each
worker's process group and the agent keeps monitoring the workers (torch's agent raises
`SignalException`, shuts them down and exits 1): the ranks save and exit 0, and so does the launch.
A worker failing after it still fails the launch, with no restart. A signal while no worker runs
keeps torch's handling. docs/training.md#preemption-sigterm-ctrl-c-time-limits-requeued-jobs.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from megatron_csbp.utils.cli import CliError, run

#: (module, attribute path) of the torch elastic API the forwarding replaces or wraps
TORCH_API = (("torch.distributed.elastic.multiprocessing.api", "PContext.start"),
             ("torch.distributed.elastic.multiprocessing.api", "SignalException"),
             ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._restart_workers"))


def _torch_api():
    """The objects of TORCH_API, or one CliError naming those this torch lacks."""
    import importlib

    import torch

    found, missing = [], []
    for module, path in TORCH_API:
        obj = importlib.import_module(module)
        for name in path.split("."):
            obj = getattr(obj, name, None)
        (found if obj is not None else missing).append(obj if obj is not None else f"{module}.{path}")
    if missing:
        raise CliError(f"--exit-signal-handler: torch {torch.__version__} has no {', '.join(missing)}, which "
                       "megatron_csbp.launch.torchrun needs to forward SIGTERM to the workers (plain torchrun "
                       "works, but exits 1 after a SIGTERM of its own)")
    return found


def exit_signal_of(argv) -> signal.Signals:
    """The job's `--exit-signal` (Megatron-LM's flag; SIGTERM unless given)."""
    for i, a in enumerate(argv):
        if a.startswith("--exit-signal="):
            return signal.Signals[a.split("=", 1)[1]]
        if a == "--exit-signal" and i + 1 < len(argv) and argv[i + 1] in signal.Signals.__members__:
            return signal.Signals[argv[i + 1]]
    return signal.SIGTERM


def forward_signals(sigs=(signal.SIGTERM, signal.SIGINT)) -> None:
    """Patch torch's elastic agent (this process) so that each of `sigs` is forwarded to its workers,
    which it keeps monitoring, and a worker group that fails after it is not restarted (module docstring)."""
    start, SignalException, restart = _torch_api()
    forwarded, got = [], []  # the pids a signal was forwarded to; the signals

    def start_and_forward(pcontext) -> None:
        start(pcontext)  # torch's: the workers, and its handlers (SIGTERM raises SignalException)
        if threading.current_thread() is not threading.main_thread():
            return  # torch installs no handler there either

        def forward(signum, frame):
            # to each worker's process group (torchrun starts each worker in a session of its own, and
            # torch's shutdown signals the group: the rank and its helper processes); `sent`: those still there
            sent = []
            for pid in pcontext.pids().values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signum)
                    sent.append(pid)
            if not sent and not forwarded:  # no worker that could save: torch's shutdown
                raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
            forwarded.extend(sent)
            got.append(signal.Signals(signum))
            if sent:
                name = signal.Signals(signum).name
                os.write(2, f"megatron_csbp.launch.torchrun: {name} forwarded to the workers (pids "
                            f"{' '.join(map(str, sent))}; --exit-signal-handler: they save the iteration they "
                            "reach and exit); waiting for them\n".encode())

        for sig in sigs:
            signal.signal(sig, forward)

    def restart_unless_signalled(agent, worker_group) -> None:
        if forwarded:
            raise SignalException(f"Process {os.getpid()} got signal: {int(got[-1])} (forwarded to the "
                                  "workers, which failed: no restart)", sigval=got[-1])
        restart(agent, worker_group)

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    PContext.start, SimpleElasticAgent._restart_workers = start_and_forward, restart_unless_signalled


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--exit-signal-handler" in argv:
        forward_signals(tuple(dict.fromkeys((exit_signal_of(argv), signal.SIGTERM, signal.SIGINT))))
    from torch.distributed.run import main as torchrun

    torchrun(argv)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
