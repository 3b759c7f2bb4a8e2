"""Ctrl-C (SIGINT) to a torchrun job, delivered as a terminal delivers it: to the foreground process
group, i.e. torchrun's (its ranks lead sessions of their own; torchrun sends them the signal).

With `--exit-signal-handler` the ranks save the iteration they reach, as on SIGTERM, and say so in
one line; plain torchrun still exits 1 after its own SignalException (torch's agent), while
`megatron_csbp.launch.torchrun` forwards the signal and exits 0. Without the handler the run ends in
one `error:` line saying what is lost. Before: 195 traceback lines and nothing saved (issue 41).
"""
import os
import re
import signal
import subprocess
import time

import pytest

from megatron_csbp.checkpoint import files
from megatron_csbp.launch.recipes import TORCHRUN
from tests.train_helpers import TINY, error_lines, json_log, train_command

CSBP = ["--context-parallel-size", "2", "--block-parallel-size", "2"]


def _ctrl_c(tmp_path, launcher, extra):
    """Run 2-rank CSBP under `launcher`, SIGINT torchrun's process group at iteration 3: (rc, out, err)."""
    log = str(tmp_path / "log.jsonl")
    argv = TINY + CSBP + ["--train-iters", "500", "--log-json", log] + extra
    with open(tmp_path / "out", "w") as fo, open(tmp_path / "err", "w") as fe:
        proc = subprocess.Popen(train_command(argv, 2, ["--monitor-interval", "0.1"], launcher), stdout=fo,
                                stderr=fe, start_new_session=True)  # the test's own group is not the terminal's
        try:
            end = time.time() + 240
            while not (os.path.exists(log) and len(json_log(log)) >= 3):
                assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
                assert time.time() < end, "iteration 3 not reached"
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
        finally:
            proc.kill()
    return proc.returncode, (tmp_path / "out").read_text(), (tmp_path / "err").read_text()


def _rank_lines(err):
    """What the ranks printed to stderr (torchrun's own log lines and traceback left out)."""
    torch_tb = err.find("Traceback (most recent call last):\n  File \"<frozen runpy>\"")
    err = err[:torch_tb] if torch_tb >= 0 else err
    return [line for line in err.splitlines() if line.strip() and not re.match(r"[WIE]\d{4} ", line)
            and not line.startswith(("*****", "Setting OMP_NUM_THREADS"))]


@pytest.mark.parametrize("launcher", ["torch.distributed.run",
                                      pytest.param(TORCHRUN, marks=pytest.mark.slow)])  # launch: 20 s more
def test_ctrl_c_with_exit_signal_handler_saves(tmp_path, launcher):
    save = str(tmp_path / "ckpt")
    rc, out, err = _ctrl_c(tmp_path, launcher, ["--save", save, "--save-interval", "1000", "--exit-signal-handler"])
    m = re.search(r"received SIGINT \(--exit-signal-handler\): exiting after iteration (\d+); resume with "
                  + re.escape(f"--load {save}"), out)
    assert m, out[-2000:] + err[-3000:]
    assert files.read_tracker(save) == int(m.group(1)) >= 3
    assert files.verify_files(files.iteration_dir(save, int(m.group(1)))) is None
    assert _rank_lines(err) == ([] if launcher == "torch.distributed.run" else
                                [line for line in _rank_lines(err) if "SIGINT forwarded to the workers" in line]), err
    assert rc == (0 if launcher == TORCHRUN else 1), err[-2000:]  # plain torchrun: torch's SignalException


def test_ctrl_c_without_the_handler_is_one_line(tmp_path):
    rc, out, err = _ctrl_c(tmp_path, "torch.distributed.run", [])
    assert _rank_lines(err) == error_lines(err), err
    line, = error_lines(err)
    assert re.fullmatch(r"error: interrupted by SIGINT after iteration \d+: nothing was saved, the work since is "
                        r"lost \(--exit-signal-handler with --save saves the iteration reached on SIGINT or SIGTERM "
                        r"and exits 0\)", line), line
