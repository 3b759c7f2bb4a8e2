"""Logs: --log-json fields, TensorBoard events, eval, --skip-train (the embedded default run:
tests/test_train_default_run.py)."""
import json
import os

from tests.distributed import run_distributed
from tests.train_helpers import TINY, train_rank


def test_log_json_tensorboard_eval_and_skip_train(tmp_path):
    log, tb = str(tmp_path / "log.jsonl"), str(tmp_path / "tb")
    run_distributed(train_rank, 2, TINY + ["--context-parallel-size", "2", "--block-parallel-size", "2",
                                           "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
                                           "--log-json", log, "--tensorboard-dir", tb])
    recs = [json.loads(l) for l in open(log)]
    assert [r["iteration"] for r in recs] == [1, 2]
    for r in recs:
        for key in ("iteration", "loss", "grad_norm", "lr", "tokens_per_second", "attn_comm_bytes",
                    "peak_memory_bytes", "tflops_per_gpu", "consumed_samples", "ms_per_iteration"):
            assert key in r, key
        assert r["attn_comm_bytes"] > 0  # CSBP moves clean K/V
        assert r["peak_memory_bytes"] > 2 ** 20
    assert "eval_loss" in recs[1] and recs[1]["eval_loss"] > 0
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb))
    # --skip-train: evaluation only, same eval batches => same value under another layout.
    only = run_distributed(train_rank, 1, TINY + ["--train-iters", "2", "--skip-train", "--eval-iters", "1"])[0]
    assert only["iteration"] == 0 and "eval_loss" in only["history"][0]
