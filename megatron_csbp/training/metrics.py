"""What a training run reports: the log line, JSON lines, TensorBoard scalars, the progress bar, peak
memory, and the FLOPs model of the block-diffusion mask (`flops_per_sample`, with the objective's
terms), which `Trainer` turns into the TFLOP/s per GPU it logs.
"""
from __future__ import annotations

import json
import os
import resource
import sys
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_csbp.training.config import BatchConfig, LogConfig


def flops_per_sample(args) -> float:
    """Forward + backward FLOPs of one sample, counting the logical (not replicated) work. A dense
    estimate: MoE models (DiffusionGemma) count their dense MLP only; the rows and attention pairs
    are the objective's (`Objective.rows_per_sample`, `views`, `attention_pairs`): diffusiongemma-sft
    counts a canvas over the whole sequence (an upper bound: prompt blocks have no canvas)."""
    from megatron_csbp.model.builder import embedding_rows
    from megatron_csbp.objectives import objective_class

    objective = objective_class(args.objective)
    L, h, ffn, layers = args.seq_length, args.hidden_size, args.ffn_hidden_size, args.num_layers
    heads, groups = args.num_attention_heads, args.num_query_groups
    d = getattr(args, "kv_channels", None) or h // heads
    views = objective.views  # fast-dllm-v2 doubles the batch (two complementary views), each view 2L rows
    rows = objective.rows_per_sample(L)
    per_row = 2 * h * (heads * d + 2 * groups * d) + 2 * heads * d * h
    per_row += (6 if args.swiglu else 4) * h * ffn
    linear = rows * per_row * layers
    # allowed query-key pairs of one view, e.g. L*(L+B) for block-causal BD3-LM
    pairs = objective.attention_pairs(L, args.block_size, args.clean_attention)
    attn = 4 * views * pairs * heads * d * layers
    # the output layer computes every embedding row's logit: the padded vocabulary (as Megatron-LM counts)
    logits = 2 * views * L * h * embedding_rows(args)
    return 3.0 * (linear + attn + logits)


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: kB


def allreduce(values: List[float], op=dist.ReduceOp.SUM, group=None) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64,
                     device=torch.cuda.current_device() if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class Logger:
    """Rank 0 prints Megatron-LM's log line and appends JSON lines; the last rank (where Megatron-LM
    writes them too) holds the TensorBoard writer and the wandb run (--wandb-project; WANDB_MODE=offline
    logs without an account); a tqdm bar on an interactive stderr."""

    def __init__(self, log: LogConfig, batch: BatchConfig, start_iteration: int = 0):
        self.batch = batch
        self.rank = dist.get_rank()
        self.last = dist.get_world_size() - 1
        self.json_path = log.log_json
        self.tb = None
        if log.tensorboard_dir and self.rank == self.last:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir=log.tensorboard_dir)
        self.wandb = None
        if log.wandb_project and self.rank == self.last:  # Megatron-LM's wandb writer rank
            import wandb

            os.makedirs(log.wandb_save_dir, exist_ok=True)
            self.wandb = wandb.init(dir=log.wandb_save_dir, name=log.wandb_exp_name, project=log.wandb_project,
                                    config=dict(log.flags or {}))
        self.bar = None
        if self.rank == 0 and not log.no_progress_bar and sys.stderr.isatty():
            # tqdm on stderr: iterations done, rate and ETA; log lines are written above it.
            from tqdm import tqdm
            self.bar = tqdm(total=batch.train_iters, initial=start_iteration, desc="train", dynamic_ncols=True,
                            leave=False)

    def write(self, rec: Dict):
        args = self.batch
        if self.tb is not None:
            it = rec["iteration"]
            for key in ("loss", "grad_norm", "lr", "tokens_per_second", "attn_comm_bytes", "peak_memory_bytes",
                        "tflops_per_gpu", "eval_loss"):
                if rec.get(key) is not None:
                    self.tb.add_scalar("lm loss" if key == "loss" else key, rec[key], it)
            self.tb.flush()
        if self.wandb is not None:  # Megatron-LM's names ("lm loss", "grad-norm", "learning-rate", ...)
            names = {"loss": "lm loss", "grad_norm": "grad-norm", "lr": "learning-rate", "eval_loss": "lm loss validation",
                     "tokens_per_second": "tokens-per-second", "tflops_per_gpu": "throughput", "consumed_samples":
                     "consumed-samples", "ms_per_iteration": "iteration-time-ms"}
            self.wandb.log({names[k]: rec[k] for k in names if rec.get(k) is not None}, step=rec["iteration"])
        if self.rank != 0:
            return
        if self.json_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.json_path)), exist_ok=True)
            with open(self.json_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if "loss" in rec:
            line = (f" iteration {rec['iteration']:8d}/{args.train_iters:8d} |"
                    f" consumed samples: {rec['consumed_samples']:12d} |"
                    f" elapsed time per iteration (ms): {rec['ms_per_iteration']:.1f} |"
                    f" throughput per GPU (TFLOP/s/GPU): {rec['tflops_per_gpu']:.4f} |"
                    f" learning rate: {rec['lr']:.6E} |"
                    f" global batch size: {args.global_batch_size:5d} |"
                    f" lm loss: {rec['loss']:.6E} |"
                    f" grad norm: {rec['grad_norm']:.4f} |"
                    f" attn comm (MiB): {rec['attn_comm_bytes'] / 2 ** 20:.2f} |"
                    f" peak mem (MiB): {rec['peak_memory_bytes'] / 2 ** 20:.0f} |"
                    f" tokens/s: {rec['tokens_per_second']:.0f} |"
                    f" ETA: {_hms(rec['eta_seconds'])}")
            if self.bar is not None:
                self.bar.write(line)
                self.bar.set_postfix(loss=f"{rec['loss']:.3f}")
            else:
                print(line, flush=True)
        if rec.get("eval_loss") is not None:
            msg = f" validation loss at iteration {rec['iteration']} | lm loss value: {rec['eval_loss']:.6E}"
            (self.bar.write if self.bar is not None else print)(msg)

    def step(self):
        if self.bar is not None:
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
