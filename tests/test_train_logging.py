"""Logs: --log-json fields, TensorBoard events, eval, --skip-train (the embedded default run:
tests/test_train_default_run.py). The logged learning rates, FLOPs rate and throughput are pinned
against closed formulas; the evaluation loss against another layout reading the same checkpoint."""
import json
import math
import os

import pytest

from tests.distributed import run_distributed
from tests.train_helpers import TINY, train_rank


def megatron_lr(it, lr=1e-2, min_lr=1e-3, warmup=1, decay=3):
    """Megatron's OptimizerParamScheduler (linear warmup from 0, then cosine to --min-lr over
    --lr-decay-iters = --train-iters) after `it` optimizer steps: the lr logged at iteration `it`."""
    if it <= warmup:
        return lr * it / warmup
    ratio = (it - warmup) / (decay - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


# FLOPs of one TINY sample under BD3-LM, written out (forward + backward = 3 x forward):
# L = 32, B = 8, h = 32, 4 heads of d = 8, 2 query groups, SwiGLU ffn 96 (the trainer's default
# 3 h), 128 logits (--vocab-size 64: 65 ids padded to 128), 2 layers. Rows: 2L = 64 (noisy + clean). Per row and layer: QKV 2 h (4 d + 2 * 2 d)
# = 4096, attention output 2 h h = 2048, SwiGLU 3 matmuls 6 h ffn = 18432. Attention: 4 d per
# allowed query-key pair per head (QK^T and PV, 2 FLOPs each); BD3-LM's pairs are L (L + B) = 1280
# (noisy block i sees its own block and the i clean blocks before it, clean block i sees blocks
# 0..i: B^2 (n + n^2) for n = L / B blocks). Logits: 2 L h V on the L noisy rows, V the padded
# vocabulary (the output layer's columns; Megatron-LM counts it too).
TINY_BD3LM_FLOPS = 3 * (2 * 32 * (4096 + 2048 + 18432) * 2 + 4 * 32 * (32 + 8) * 4 * 8 * 2 + 2 * 32 * 32 * 128)


def test_log_json_tensorboard_eval_and_skip_train(tmp_path):
    log, tb, ckpt = str(tmp_path / "log.jsonl"), str(tmp_path / "tb"), str(tmp_path / "ckpt")
    run_distributed(train_rank, 2, TINY + ["--context-parallel-size", "2", "--block-parallel-size", "2",
                                           "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1",
                                           "--lr-decay-style", "cosine", "--log-json", log, "--tensorboard-dir", tb, "--save", ckpt])
    recs = [json.loads(line) for line in open(log)]
    assert [r["iteration"] for r in recs] == [1, 2, 3]
    for r in recs:
        for key in ("iteration", "loss", "grad_norm", "lr", "tokens_per_second", "attn_comm_bytes",
                    "peak_memory_bytes", "tflops_per_gpu", "consumed_samples", "ms_per_iteration"):
            assert key in r, key
        assert r["attn_comm_bytes"] > 0  # CSBP moves clean K/V (bytes pinned in tests/test_traffic_collectives.py)
        assert r["peak_memory_bytes"] > 2 ** 20
        assert r["consumed_samples"] == 4 * r["iteration"]
        # Megatron's schedule, to the last bit a float64 cos allows
        assert r["lr"] == pytest.approx(megatron_lr(r["iteration"]), rel=1e-12)
        # rates from the logged time per iteration: 4 samples x 32 tokens, TINY_BD3LM_FLOPS each, 2 GPUs
        seconds = r["ms_per_iteration"] / 1000
        assert r["tokens_per_second"] == pytest.approx(4 * 32 / seconds, rel=1e-9)
        assert r["tflops_per_gpu"] == pytest.approx(TINY_BD3LM_FLOPS * 4 / seconds / 2 / 1e12, rel=1e-9)
    assert [megatron_lr(i) for i in (1, 2, 3)] == pytest.approx([1e-2, 5.5e-3, 1e-3])
    assert "eval_loss" in recs[2] and recs[2]["eval_loss"] > 0
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb))
    # --skip-train: evaluation only. One rank reading the iteration-3 checkpoint evaluates the same
    # batches with the same noise (keyed by evaluation sample index), so its value is CSBP's: within
    # the suite's layout tolerance (1e-5 relative, tests/test_train_layouts.py: fp32 sums in another
    # order over 2 ranks, measured ~1e-7).
    # (the run's own schedule flags: a resume with another schedule is refused, as in Megatron-LM)
    only = run_distributed(train_rank, 1, TINY + ["--train-iters", "3", "--skip-train", "--eval-iters", "1",
                                                  "--lr-decay-style", "cosine", "--load", ckpt])[0]
    assert only["iteration"] == 3
    assert only["history"][0]["eval_loss"] == pytest.approx(recs[2]["eval_loss"], rel=1e-5, abs=0)


def test_flops_per_sample_closed_formula():
    """The trainer's FLOPs model for TINY equals the formula above (11,206,656 FLOPs per sample)."""
    from megatron_csbp.training.arguments import build_parser, validate_args
    from megatron_csbp.training.metrics import flops_per_sample

    args = validate_args(build_parser().parse_args(TINY + ["--train-iters", "3"]), 1, check_only=True)
    assert TINY_BD3LM_FLOPS == 11_206_656
    assert flops_per_sample(args) == TINY_BD3LM_FLOPS
