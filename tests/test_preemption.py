"""`--exit-signal-handler` under torchrun, with SIGTERM delivered the way clusters deliver it (issue 34):

- `step`: to every process of the job step (Slurm's proctrack signals every process of the step at
  preemption, `scancel` or the time limit: torchrun, the ranks, and the helper processes the ranks
  started), here every process group of the launched process tree;
- `torchrun`: to torchrun alone (`megatron_csbp.launch.torchrun`, what `launch` runs an
  `--exit-signal-handler` job with: it forwards SIGTERM to each rank's process group and keeps
  monitoring the ranks);
- `ranks`: to each rank's process group (a rank with its helpers, as `srun` without torchrun or
  torchrun's own shutdown deliver it);
- `step_twice`: `step`, and again to every process while the checkpoint is being written.

Each run of a 2-rank CSBP job must end with a complete checkpoint at the iteration it reached (no
`iter_*.tmp-*` left), the ranks exiting cleanly (no rank traceback), the launch exiting 0, and the
same command resumes it with losses equal to an uninterrupted run's to the last digit. Before the
fix, `step`, `torchrun` and `ranks` died in the save with BrokenPipeError (megatron-core's Manager
queue process was killed by the signal) and left `iter_N.tmp-*`; and under torch's own torchrun
`step`, `torchrun` and `step_twice` exit 1 although the ranks saved and exited 0 (its agent raises
`SignalException` for a signal of its own and shuts the ranks down: tests/test_launch.py).
"""
import os
import re
import signal
import subprocess
import time

import pytest

from megatron_csbp.checkpoint import files
from megatron_csbp.launch.recipes import TORCHRUN
from tests.train_helpers import TINY, json_log, run_train, train_command

ITERS = 12
CSBP = ["--context-parallel-size", "2", "--block-parallel-size", "2"]
pytestmark = pytest.mark.slow


def _argv(log, save=None, extra=()):
    argv = TINY + CSBP + ["--train-iters", str(ITERS), "--log-json", log] + list(extra)
    return argv + (["--save", save, "--load", save, "--exit-signal-handler", "--save-interval", "3"] if save else [])


def _losses(records):
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("preempt_ref") / "log.jsonl")
    r = run_train(_argv(log), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(json_log(log))
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


def _tree(root):
    """PIDs of `root` and all its descendants."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _killpg_all(pids, sig=signal.SIGTERM):
    """Signal every process group the given processes belong to (each once)."""
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            pass
    for g in groups:
        try:
            os.killpg(g, sig)
        except OSError:
            pass
    return groups


def _tmp_dirs(save):
    return [n for n in os.listdir(save) if ".tmp" in n] if os.path.isdir(save) else []


@pytest.mark.parametrize("target", ["step", "torchrun", "ranks", "step_twice"])
def test_sigterm_under_torchrun_saves_and_resumes_exactly(reference, tmp_path, target):
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    argv = _argv(log, save)
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with open(out_path, "w") as fo, open(err_path, "w") as fe:
        # a session of its own, as a job step: killpg reaches torchrun and nothing of the test
        proc = subprocess.Popen(train_command(argv, 2, ["--monitor-interval", "0.1"], TORCHRUN), stdout=fo,
                                stderr=fe, start_new_session=True)
        try:
            end = time.time() + 300
            while not (os.path.exists(log) and max(_losses(json_log(log)) or [0]) >= 4):
                assert proc.poll() is None, err_path.read_text()[-3000:]
                assert time.time() < end, "iteration 4 not reached"
                time.sleep(0.02)
            tree = _tree(proc.pid)
            ranks = [p for p in tree if p != proc.pid and os.getpgid(p) == p]  # torchrun's workers lead sessions
            assert len(ranks) == 2, tree
            if target in ("step", "step_twice"):
                assert len(_killpg_all(tree)) == 3  # torchrun's group and the two ranks' sessions
            elif target == "torchrun":
                os.kill(proc.pid, signal.SIGTERM)
            else:
                _killpg_all(ranks)
            if target == "step_twice":
                while not _tmp_dirs(save):  # the save after the signal has begun
                    assert proc.poll() is None, err_path.read_text()[-3000:]
                    assert time.time() < end, "no save began after the signal"
                    time.sleep(0.002)
                _killpg_all(_tree(proc.pid))  # every process again, the checkpoint writers included
            proc.wait(timeout=240)
        finally:
            proc.kill()
            for p in _tree(proc.pid):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
    out, err = out_path.read_text(), err_path.read_text()
    # the ranks exit cleanly, and so does the launch: launch_torchrun forwarded a SIGTERM it got itself
    assert "BrokenPipeError" not in err and "[rank" not in err and "error:" not in err, err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    assert ("megatron_csbp.launch.torchrun: SIGTERM forwarded to the workers" in err) == (target != "ranks"), err
    records = json_log(log)
    first = _losses(records)
    stopped = max(first)
    assert 4 <= stopped < ITERS
    m = re.search(r"received SIGTERM \(--exit-signal-handler\): exiting after iteration (\d+); resume with "
                  + re.escape(f"--load {save}"), out)
    assert m and int(m.group(1)) == stopped, out[-2000:]
    # a complete, atomic checkpoint at the iteration reached
    assert _tmp_dirs(save) == []
    assert files.read_tracker(save) == stopped and stopped in files.saved_iterations(save)
    assert files.verify_files(files.iteration_dir(save, stopped)) is None
    # the same command resumes it: every loss equals the uninterrupted run's, to the last digit
    r = run_train(argv, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"loaded checkpoint {files.iteration_dir(save, stopped)} (iteration {stopped}" in r.stdout
    resumed = _losses(json_log(log)[len(records):])
    assert sorted(resumed) == list(range(stopped + 1, ITERS + 1))
    assert first == {i: reference[i] for i in range(1, stopped + 1)}
    assert resumed == {i: reference[i] for i in range(stopped + 1, ITERS + 1)}, "the resume must continue the curve"
    assert files.read_tracker(save) == ITERS
