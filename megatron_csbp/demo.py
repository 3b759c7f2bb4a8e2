"""Single-rank block-diffusion training of a tiny Megatron-core GPT on the shipped corpus.

    python -m megatron_csbp.demo [--steps 600] [--output-dir runs/demo]   (--help for every flag)

The corpus (the Python language reference text of `megatron_csbp.data`, or `--corpus`) is tokenized
into Megatron's indexed format with an EOD token after every document, and the last 10% of the
documents are held out (Megatron's `--split`). A stock megatron-core `GPTModel` (local layer spec
with the core attention swapped for `BlockDiffusionAttention`; RMSNorm, SwiGLU, rotary) is trained
by the trainer (`Trainer.train_step`: Megatron's DDP and Adam, cosine schedule) with the BD3-LM
objective (mask token excluded from the softmax, 1/t weights). Training draws block times from the
clipped range [0.3, 0.8] (BD3-LM's clipped schedule, which cuts the variance of the 1/t weights);
every reported loss is the NELBO with the full range t ~ U[1e-3, 1] (`Trainer.evaluate`): an upper
bound on the model's negative log-likelihood in nats/token. It is compared to the unigram entropy
of the training tokens (the loss of the best context-free model): a held-out NELBO below it means
the model uses context.

Prints a progress line every `--log-interval` steps, the unigram entropy and the final train and
held-out losses; writes `loss_curve.png` and `metrics.json` to `--output-dir` (default runs/demo).
One rank (world size 1); CPU, or one GPU when CUDA is available.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_csbp.training.demo import DemoConfig, split, trainer_flags


@dataclass
class DemoResult:
    unigram_entropy: float
    train_losses: List[float]
    eval_steps: List[int] = field(default_factory=list)
    eval_losses: List[float] = field(default_factory=list)
    final_train_loss: float = float("nan")  # NELBO on training rows (same estimator as eval)
    final_train_objective: float = float("nan")  # mean training objective over the last steps
    final_eval_loss: float = float("nan")
    train_rows: int = 0
    eval_rows: int = 0
    seconds: float = 0.0
    plot_path: Optional[str] = None


def init_single_rank() -> None:
    """gloo world of size 1 and Megatron's model-parallel state with TP = PP = 1 (idempotent)."""
    from megatron.core import parallel_state as mpu

    from megatron_csbp.parallel.spawn import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(f"the demo runs on one rank, torch.distributed has {dist.get_world_size()}")
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1)


def prepare_data(cfg: DemoConfig, data_dir: str):
    """The corpus in Megatron's indexed format under `data_dir` (an EOD after every document).
    Returns (prefix, unigram entropy of the training split's tokens, train rows, held-out rows,
    vocabulary size)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_csbp.data import DEFAULT_CORPUS, unigram_entropy
    from megatron_csbp.data.megatron_data import _split_documents, _split_matrix, build_tokenizer
    from megatron_csbp.data.preprocess import preprocess

    tokenizer = build_tokenizer("SentencePieceTokenizer", cfg.tokenizer, None)
    os.makedirs(data_dir, exist_ok=True)
    prefix = preprocess(cfg.corpus or DEFAULT_CORPUS, os.path.join(data_dir, "corpus"), tokenizer,
                        append_eod=True)
    docs = IndexedDataset(prefix)
    matrix = _split_matrix(split(cfg))
    (t0, t1), (v0, v1) = (_split_documents(matrix[i], len(docs)) for i in (0, 1))
    train = np.concatenate([docs[i] for i in range(t0, t1)])
    held_out = int(docs.sequence_lengths[v0:v1].sum())
    entropy = unigram_entropy([train.tolist()], tokenizer.vocab_size)
    return prefix, entropy, len(train) // cfg.seq_length, held_out // cfg.seq_length, tokenizer.vocab_size


def run(cfg: DemoConfig, log=print) -> DemoResult:
    from megatron.core import parallel_state as mpu

    from megatron_csbp.parallel import state as bps
    from megatron_csbp.training.arguments import parse_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer

    if cfg.steps <= 0:
        raise ValueError(f"--steps must be positive, got {cfg.steps}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.time()
    data_dir = os.path.join(cfg.output_dir or tempfile.mkdtemp(prefix="demo_"), "data")
    prefix, entropy, train_rows, eval_rows, vocab = prepare_data(cfg, data_dir)
    if cfg.max_eval_rows is not None:
        eval_rows = min(eval_rows, cfg.max_eval_rows)
    log(f"corpus: {train_rows} train / {eval_rows} held-out sequences of {cfg.seq_length} tokens, "
        f"vocab {vocab}, block size {cfg.block_size}")
    log(f"unigram entropy of the training tokens: {entropy:.4f} nats/token")
    G = cfg.batch_size
    eval_iters = cfg.eval_repeats * max(1, math.ceil(eval_rows / G))
    run = parse_args(trainer_flags(cfg, prefix, eval_iters) + ["--data-cache-path", os.path.join(data_dir, "cache")],
                     world_size=1)
    if mpu.model_parallel_is_initialized() and not bps.is_initialized():
        mpu.destroy_model_parallel()  # Megatron's groups alone (init_single_rank): the trainer makes its own
    trainer = Trainer(TrainerConfig.from_args(run)).build()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    log(f"model: megatron-core GPTModel, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{n_params / 1e6:.2f}M parameters, device {next(trainer.model.parameters()).device}")

    result = DemoResult(unigram_entropy=entropy, train_losses=[], train_rows=train_rows, eval_rows=eval_rows)
    t_train = time.time()
    for step in range(cfg.steps):
        lr = trainer.optimizer.param_groups[0]["lr"]
        loss = trainer.train_step(step * G).loss  # a non-finite loss stops the trainer (TrainingStopped)
        result.train_losses.append(loss)
        last = step + 1 == cfg.steps
        if cfg.eval_interval and ((step + 1) % cfg.eval_interval == 0 or last):
            result.eval_steps.append(step + 1)
            result.eval_losses.append(trainer.evaluate())
        if cfg.log_interval and ((step + 1) % cfg.log_interval == 0 or last or step == 0):
            window = result.train_losses[-cfg.log_interval:]
            rate = (step + 1) / (time.time() - t_train)
            line = (f"step {step + 1:4d}/{cfg.steps} | loss {loss:7.4f} | avg {sum(window) / len(window):7.4f} "
                    f"| lr {lr:.2e} | {rate:5.2f} steps/s")
            if result.eval_steps and result.eval_steps[-1] == step + 1:
                line += f" | eval {result.eval_losses[-1]:7.4f}"
            log(line)
    if not result.eval_steps or result.eval_steps[-1] != cfg.steps:
        result.eval_steps.append(cfg.steps)
        result.eval_losses.append(trainer.evaluate())
    tail = result.train_losses[-max(1, min(cfg.log_interval, len(result.train_losses))):]
    result.final_train_objective = sum(tail) / len(tail)
    # The train NELBO with the eval estimator, on as many training batches as held-out ones.
    result.final_train_loss = trainer.evaluate(trainer.train_ds)
    result.final_eval_loss = result.eval_losses[-1]
    result.seconds = time.time() - t0

    log(f"unigram entropy:  {entropy:.4f} nats/token")
    log(f"final train loss: {result.final_train_loss:.4f} nats/token (BD3-LM NELBO on training rows; "
        f"training objective, mean of last {len(tail)} steps: {result.final_train_objective:.4f})")
    log(f"final eval loss:  {result.final_eval_loss:.4f} nats/token (BD3-LM NELBO, held-out, upper bound on NLL)")
    log(f"time: {result.seconds:.1f} s")
    if cfg.output_dir:
        os.makedirs(cfg.output_dir, exist_ok=True)
        from megatron_csbp.training.demo import plot_losses

        result.plot_path = os.path.join(cfg.output_dir, "loss_curve.png")
        plot_losses(list(enumerate(result.train_losses, 1)),
                    [{"iteration": i, "eval_loss": v} for i, v in zip(result.eval_steps, result.eval_losses)],
                    result.plot_path, entropy,
                    f"BD3-LM on one rank: L={cfg.seq_length}, B={cfg.block_size}, {cfg.num_layers}x{cfg.hidden_size}")
        with open(os.path.join(cfg.output_dir, "metrics.json"), "w") as f:
            json.dump({"config": asdict(cfg), "result": asdict(result)}, f, indent=1)
        log(f"wrote {result.plot_path} and metrics.json")
    return result


def parse_args(argv: Optional[Sequence[str]] = None) -> DemoConfig:
    defaults = DemoConfig()
    p = argparse.ArgumentParser(prog="python -m megatron_csbp.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in DemoConfig.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        name = str(f.type).replace("Optional[", "").rstrip("]")
        if name == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f"(default: {default})")
            continue
        kind = {"int": int, "float": float, "str": str}.get(name, str)
        p.add_argument(flag, type=kind, default=default, help=f"(default: {default})")
    return DemoConfig(**vars(p.parse_args(argv)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    cfg = parse_args(argv)
    try:
        run(cfg, log=lambda s: print(s, flush=True))
    finally:
        from megatron_csbp.parallel import state as bps

        if bps.is_initialized():
            bps.destroy_block_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
