"""The default run (`torchrun --nproc-per-node 2 -m megatron_csbp.train`, no flags): a short version
in the default suite (MEGATRON_CSBP_DEMO_ITERS=30: the same model, data and layout, 6 evaluations),
the full 600-iteration run under -m slow with the README's claims (held-out NELBO evaluated 6
times, falling at every evaluation, ending <= 4.8 nats/token)."""
import json
import os
import subprocess

import pytest


def run_default(tmp_path, iters=None):
    env = {**os.environ, "MEGATRON_CSBP_DEMO_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}
    if iters is not None:
        env["MEGATRON_CSBP_DEMO_ITERS"] = str(iters)
    res = subprocess.run(["torchrun", "--nproc-per-node", "2", "-m", "megatron_csbp.train"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res, tmp_path / "runs"


def check_run(res, run, iters):
    for name in ("loss_curve.png", "log.jsonl", "summary.json", "sample.txt", "command.txt"):
        assert (run / name).exists(), name
    ckpt = run / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(iters)
    assert (ckpt / "iter_0000000").is_dir()  # the untrained weights, for the comparison sample
    assert "layout csbp" in res.stdout and "ETA:" in res.stdout
    summary = json.loads((run / "summary.json").read_text())
    evals = [v for _, v in sorted(summary["eval_losses"].items(), key=lambda kv: int(kv[0]))]
    assert len(evals) >= 6, evals
    # The same held-out batches and noise at every evaluation: only the model changes.
    assert all(b < a for a, b in zip(evals, evals[1:])), evals
    sample = (run / "sample.txt").read_text()
    assert "untrained (iteration 0)" in sample and f"trained (iteration {iters})" in sample
    assert sample.count("The for statement is used to") == 3  # command line + two samples
    return evals


def test_default_run_short(tmp_path):
    res, run = run_default(tmp_path, iters=30)
    evals = check_run(res, run, 30)
    assert evals[-1] < evals[0] - 0.5, evals


@pytest.mark.slow
def test_default_run_full(tmp_path):
    res, run = run_default(tmp_path)
    evals = check_run(res, run, 600)
    print("held-out NELBO:", evals)
    assert evals[-1] <= 4.8, evals
