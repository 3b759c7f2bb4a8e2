"""The embedded default of `torchrun --nproc-per-node 2 -m megatron_csbp.train` (no flags).

On a fresh clone it:
1. preprocesses the shipped real-English corpus (CPython's pydoc topics, PSF License; built with its
   sentencepiece tokenizer by `python -m megatron_csbp.data.tokenizer build`) into Megatron's
   indexed format under `runs/default/data/` (once; rank 0 writes, the others wait);
2. trains a small BDLM (4 layers, hidden 128, GQA 4/2 heads, seq 128, block 16) with CSBP:
   CP = BP = world size (2 ranks: one clean ring of 2, each rank owns a mirrored pair of noisy
   blocks), Megatron DDP + optimizer, eval on the held-out split;
3. saves a checkpoint (`runs/default/checkpoints`), TensorBoard events, `log.jsonl`, a loss plot
   `loss_curve.png`, and prints a sample decoded from the checkpoint.

The exact equivalent command is printed at start (and written to `runs/default/command.txt`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List

RUN_DIR = os.environ.get("MEGATRON_CSBP_DEMO_DIR", os.path.join("runs", "default"))
TRAIN_ITERS = int(os.environ.get("MEGATRON_CSBP_DEMO_ITERS", "300"))


def demo_argv(world_size: int, prefix: str) -> List[str]:
    seq = max(1, world_size)
    return [
        "--data-path", prefix, "--split", "95,5,0", "--tokenizer-type", "SentencePieceTokenizer",
        "--seq-length", "128", "--block-size", "16",
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--micro-batch-size", "4", "--global-batch-size", "8",
        "--train-iters", str(TRAIN_ITERS), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "20",
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
        "--context-parallel-size", str(seq), "--block-parallel-size", str(seq),
        "--save", os.path.join(RUN_DIR, "checkpoints"), "--save-interval", str(TRAIN_ITERS),
        "--eval-interval", "100", "--eval-iters", "2", "--log-interval", "20",
        "--tensorboard-dir", os.path.join(RUN_DIR, "tensorboard"),
        "--log-json", os.path.join(RUN_DIR, "log.jsonl"),
        "--data-cache-path", os.path.join(RUN_DIR, "data", "cache"),
    ]


def prepare_demo(world_size: int) -> List[str]:
    rank = int(os.environ.get("RANK", "0"))
    data_dir = os.path.join(RUN_DIR, "data")
    prefix = os.path.join(data_dir, "pydoc_text_document")
    done = prefix + ".done"
    if rank == 0:
        if not os.path.exists(done):
            from megatron_csbp.data.preprocess import main as preprocess
            os.makedirs(data_dir, exist_ok=True)
            preprocess(["--input", "shipped", "--output-prefix", os.path.join(data_dir, "pydoc"), "--append-eod"])
            with open(done, "w") as f:
                f.write("ok\n")
        for stale in ("checkpoints", "tensorboard", "log.jsonl", "loss_curve.png", "sample.txt"):
            path = os.path.join(RUN_DIR, stale)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        argv = demo_argv(world_size, prefix)
        cmd = f"torchrun --nproc-per-node {world_size} -m megatron_csbp.train " + " ".join(argv)
        with open(os.path.join(RUN_DIR, "command.txt"), "w") as f:
            f.write(cmd + "\n")
        print(f" > embedded demo (no flags given); equivalent command:\n   {cmd}", flush=True)
    else:
        # Rank 0 joins the process group only after preparing; waiting for the file is enough.
        deadline = time.time() + 600
        while not os.path.exists(done):
            if time.time() > deadline:
                raise RuntimeError(f"rank {rank}: rank 0 did not prepare {done}")
            time.sleep(0.5)
    return demo_argv(world_size, prefix)


def plot_losses(history: List[Dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(h["iteration"], h["loss"]) for h in history if "loss" in h]
    ev = [(h["iteration"], h["eval_loss"]) for h in history if h.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if tr:
        ax.plot(*zip(*tr), label="train (BD3-LM NELBO)")
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("block diffusion LM, CSBP on CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish_demo(args, result: Dict, wall_seconds: float) -> None:
    """Rank 0, after the process groups are gone: plot, summary, a sample from the checkpoint."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    hist = result["history"]
    png = os.path.join(RUN_DIR, "loss_curve.png")
    plot_losses(hist, png)
    losses = [h["loss"] for h in hist if "loss" in h]
    evals = [h["eval_loss"] for h in hist if h.get("eval_loss") is not None]
    comm = [h["attn_comm_bytes"] for h in hist if "attn_comm_bytes" in h]
    summary = {"wall_seconds": round(wall_seconds, 1), "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "last_eval_loss": evals[-1] if evals else None,
               "attn_comm_bytes_per_iteration": comm[-1] if comm else None, "iterations": result["iteration"]}
    with open(os.path.join(RUN_DIR, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f" > demo done in {wall_seconds:.0f} s: loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}"
          f" (held-out {summary['last_eval_loss']}); attention traffic per iteration (busiest rank) "
          f"{summary['attn_comm_bytes_per_iteration']} bytes; plot {png}", flush=True)
    prompt = "The for statement is used to"
    cmd = [sys.executable, "-m", "megatron_csbp.generate", "--load", args.save, "--prompt", prompt,
           "--max-new-tokens", "48", "--temperature", "0.8", "--seed", "0"]
    print(" > sample: " + " ".join(cmd[1:]), flush=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "LOCAL_WORLD_SIZE",
                        "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")
           and not k.startswith("TORCHELASTIC_")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    sample = res.stdout.strip() if res.returncode == 0 else f"(generation failed: {res.stderr[-1000:]})"
    print(sample, flush=True)
    with open(os.path.join(RUN_DIR, "sample.txt"), "w") as f:
        f.write(sample + "\n")
