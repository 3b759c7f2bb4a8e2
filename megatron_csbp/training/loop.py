"""`python -m megatron_csbp.train`: the trainer CLI. Parses and validates the flags, builds the typed
`TrainerConfig`, and runs a `Trainer` (training/trainer.py) under torch.distributed; with no flags it
runs the embedded default (training/demo.py).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Dict, List, Optional

import torch


def main(argv: Optional[List[str]] = None, sample=None) -> Dict:
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    from megatron_csbp.training.arguments import parse_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer, _log0

    argv = list(sys.argv[1:] if argv is None else argv)
    demo = not argv
    start = time.time()
    if demo:
        from megatron_csbp.training.demo import prepare_demo
        argv = prepare_demo(int(os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    run = parse_args(argv)
    from megatron_csbp.training.signals import ExitSignal, Interruptible, exit_signals

    # --exit-signal-handler: its signals are noted from here on (Megatron-LM installs its handler at
    # initialization), so a signal while the ranks build and load ends in a save, not a kill;
    # without it a Ctrl-C ends the run in one line naming what is lost (Interruptible)
    with ExitSignal(exit_signals(run.exit_signal)) if run.exit_signal_handler else Interruptible() as exit_signal:
        with Trainer(TrainerConfig.from_args(run)) as trainer:
            _log0(trainer.describe())
            if isinstance(exit_signal, Interruptible):
                exit_signal.trainer = trainer
            result = trainer.train(exit_signal if isinstance(exit_signal, ExitSignal) else None)
    if demo:
        from megatron_csbp.training.demo import finish_demo
        finish_demo(run, result, time.time() - start, sample)  # sample: the app's decoder
    return result
