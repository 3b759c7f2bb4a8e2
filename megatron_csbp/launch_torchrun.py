"""torchrun for preemptible jobs: `python -m megatron_csbp.launch_torchrun [torchrun options] -m
megatron_csbp.train ... --exit-signal-handler`, torch's own torchrun (`torch.distributed.run.main`,
every option the same) with one change when `--exit-signal-handler` is among the arguments.

torchrun's agent answers a SIGTERM of its own (Slurm's preemption, `scancel`, the time limit; `kill`)
by shutting its workers down (SIGTERM to each worker's process group, SIGKILL after
`--shutdown-timeout`) and exiting 1 with `SignalException`, whatever the workers return. Here the
SIGTERM is forwarded to each worker's process group (as torch's shutdown signals it: the rank and the
helper processes it started) and the agent keeps monitoring: the ranks finish the iteration, save and
exit 0, and so does the launch. Every further SIGTERM is forwarded the same way (none can kill the
save). After a forwarded SIGTERM a failing worker still fails the launch, and the agent restarts
nothing (`--max-restarts`): it shuts down with torch's `SignalException`. A SIGTERM while no worker
runs (rendezvous) and SIGINT / SIGHUP / SIGQUIT keep torch's handling, as does a launch without
`--exit-signal-handler`.
"""
from __future__ import annotations

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
                       "megatron_csbp.launch_torchrun needs to forward SIGTERM to the workers (plain torchrun "
                       "works, but exits 1 after a SIGTERM of its own)")
    return found


def _signal_workers(pids, sig) -> list:
    """Send `sig` to each worker's process group (a worker torch started with a session of its own),
    else to the worker; the pids that were still there."""
    sent = []
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, sig)
                sent.append(pid)
                break
            except ProcessLookupError:
                pass
    return sent


def forward_sigterm() -> None:
    """Patch torch's elastic agent (this process) so that SIGTERM is forwarded to its workers, which
    it keeps monitoring, and a worker group that fails after it is not restarted (module docstring)."""
    start, SignalException, restart = _torch_api()
    forwarded = []  # the pids a SIGTERM was forwarded to

    def start_and_forward(pcontext) -> None:
        start(pcontext)  # torch's: the workers, and its handlers (SIGTERM raises SignalException)
        if threading.current_thread() is not threading.main_thread():
            return  # torch installs no handler there either

        def forward(signum, frame):
            sent = _signal_workers(pcontext.pids().values(), signum)
            if not sent and not forwarded:  # no worker that could save: torch's shutdown
                raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
            forwarded.extend(sent)
            os.write(2, f"megatron_csbp.launch_torchrun: SIGTERM forwarded to the workers (pids "
                        f"{' '.join(map(str, sent))}; --exit-signal-handler: they save the iteration they "
                        "reach and exit); waiting for them\n".encode())

        signal.signal(signal.SIGTERM, forward)

    def restart_unless_signalled(agent, worker_group) -> None:
        if forwarded:
            raise SignalException(f"Process {os.getpid()} got signal: {int(signal.SIGTERM)} (forwarded to the "
                                  "workers, which failed: no restart)", sigval=signal.SIGTERM)
        restart(agent, worker_group)

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    PContext.start, SimpleElasticAgent._restart_workers = start_and_forward, restart_unless_signalled


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--exit-signal-handler" in argv:
        forward_sigterm()
    from torch.distributed.run import main as torchrun

    torchrun(argv)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
