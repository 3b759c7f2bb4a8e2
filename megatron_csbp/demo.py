"""Single-rank block-diffusion training of a tiny Megatron-core GPT on the shipped corpus.

    python -m megatron_csbp.demo [--steps 600] [--output-dir runs/demo]   (--help for every flag)

A stock megatron-core `GPTModel` (local layer spec with the core attention swapped for
`BlockDiffusionAttention`; RMSNorm, SwiGLU, rotary) is trained with the BD3-LM objective (mask token
excluded from the softmax, 1/t weights) on the Python language reference text of
`megatron_csbp.data`, packed into sequences with an EOD token after every document; 10% of the
documents are held out. Training draws block times from the clipped range [0.3, 0.8] (BD3-LM's
clipped schedule, which cuts the variance of the 1/t weights); every reported loss is the NELBO
with the full range t ~ U[1e-3, 1]: an upper bound on the model's negative log-likelihood in
nats/token. It is compared to the unigram entropy of the training tokens (the loss of the best
context-free model): a held-out NELBO below it means the model uses context.

Prints a progress line every `--log-interval` steps, the unigram entropy and the final train and
held-out losses; writes `loss_curve.png` and `metrics.json` to `--output-dir` (default runs/demo).
One gloo rank (world size 1) with `parallel_state.initialize_model_parallel(1, 1)`; CPU, or one GPU
when CUDA is available.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist


@dataclass
class DemoConfig:
    steps: int = 600
    batch_size: int = 8
    seq_length: int = 128
    block_size: int = 16
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 2
    num_query_groups: int = 2
    ffn_hidden_size: int = 512
    qk_layernorm: bool = False
    init_method_std: float = 0.05  # tiny models learn attention patterns faster than with 0.02
    # Training noise schedule (BD3-LM "clipped" schedules cut the 1/t variance); the eval loss
    # always uses the full schedule t ~ U[1e-3, 1] with 1/t weights, the NELBO.
    noise_eps_min: float = 0.3
    noise_eps_max: float = 0.8
    loss_weighting: str = "inverse_t"
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    eval_fraction: float = 0.1
    eval_interval: int = 100
    eval_repeats: int = 2  # noise draws per eval row (the NELBO is a Monte-Carlo estimate)
    max_eval_rows: Optional[int] = None
    log_interval: int = 25
    # One intra-op thread by default: the matrices are small, and on shared CPUs extra threads
    # mostly spin. Raise it on an idle many-core machine.
    threads: Optional[int] = 1
    corpus: Optional[str] = None
    tokenizer: Optional[str] = None
    output_dir: Optional[str] = "runs/demo"
    device: str = "auto"


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_rank() -> None:
    """gloo world of size 1 and Megatron's model-parallel state with TP = PP = 1 (idempotent)."""
    from megatron.core import parallel_state as mpu

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(f"the demo runs on one rank, torch.distributed has {dist.get_world_size()}")
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1)


def build_gpt(cfg: DemoConfig, vocab_size: int, device: torch.device):
    """A stock megatron-core GPTModel from the local layer spec with block-diffusion attention."""
    from megatron_csbp.model import builder

    config = builder.transformer_config(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, init_method_std=cfg.init_method_std, qk_layernorm=cfg.qk_layernorm,
    )
    # Megatron's CUDA RNG tracker is not needed: CPU initialisation draws from torch's default
    # generator (seeded by the caller) and no dropout or sequence parallelism is used.
    spec = builder.local_layer_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm)
    gpt = builder.gpt_model(config, spec, vocab_size=vocab_size, max_sequence_length=cfg.seq_length,
                            position_embedding_type="rope", share_embeddings_and_output_weights=True)
    return gpt.to(device)


def prepare_data(cfg: DemoConfig, tokenizer=None):
    """(tokenizer, train rows [N, L], eval rows [M, L], unigram entropy of the train tokens)."""
    from megatron_csbp.data import (SentencePieceTokenizer, load_documents, pack_token_stream,
                                    split_documents, unigram_entropy)

    tokenizer = tokenizer or SentencePieceTokenizer(cfg.tokenizer)
    docs = load_documents(cfg.corpus)
    train_docs, eval_docs = split_documents(docs, cfg.eval_fraction, seed=cfg.seed)
    train_ids = tokenizer.tokenize_batch(train_docs)
    eval_ids = tokenizer.tokenize_batch(eval_docs)
    train = pack_token_stream(train_ids, cfg.seq_length, tokenizer.eod)
    held_out = pack_token_stream(eval_ids, cfg.seq_length, tokenizer.eod)
    if cfg.max_eval_rows is not None:
        held_out = held_out[: cfg.max_eval_rows]
    # Entropy of exactly what the model is trained on (the packed rows, EOD included).
    entropy = unigram_entropy([train.flatten().tolist()], tokenizer.vocab_size)
    return tokenizer, train, held_out, entropy


def lr_at(step: int, cfg: DemoConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model, rows: torch.Tensor, cfg: DemoConfig, device, objective=None) -> float:
    """NELBO in nats/token over the held-out rows: sum of w*CE / number of supervised tokens.

    Sample indices of eval rows live far from the training stream's, and are the same at every
    evaluation, so successive eval losses see the same noise."""
    model.eval()
    train_objective = model.objective
    if objective is not None:
        model.objective = objective
    weighted, count = 0.0, 0.0
    for r in range(cfg.eval_repeats):
        for start in range(0, len(rows), cfg.batch_size):
            tokens = rows[start : start + cfg.batch_size].to(device)
            mask = torch.ones_like(tokens)
            index = torch.arange(start, start + len(tokens)) + (1 << 40) + r * len(rows)
            out = model(tokens, mask, index, denominator=torch.tensor(1.0, device=device))
            weighted += float(out.weighted_sum)
            count += float(mask.sum())
    model.objective = train_objective
    model.train()
    return weighted / count


def plot_losses(result: DemoResult, path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(result.train_losses) + 1))
    ema, smooth = [], None
    for x in result.train_losses:
        smooth = x if smooth is None else 0.9 * smooth + 0.1 * x
        ema.append(smooth)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, result.train_losses, color="tab:blue", alpha=0.25, lw=0.8, label="train objective (per step)")
    ax.plot(steps, ema, color="tab:blue", lw=1.6, label="train objective (EMA 0.9)")
    if result.eval_steps:
        ax.plot(result.eval_steps, result.eval_losses, "o-", color="tab:red", label="held-out NELBO")
    if math.isfinite(result.final_train_loss):
        ax.plot([len(steps)], [result.final_train_loss], "s", color="tab:green", label="train-rows NELBO (final)")
    ax.axhline(result.unigram_entropy, color="k", ls="--", lw=1,
               label=f"unigram entropy {result.unigram_entropy:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("nats/token")
    ax.set_title(title)
    top = max(result.unigram_entropy * 1.6, min(max(result.train_losses), result.unigram_entropy * 3))
    low = min(result.train_losses + result.eval_losses + [result.unigram_entropy])
    ax.set_ylim(max(0.0, math.floor(low - 1.0)), top)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(cfg: DemoConfig, log=print) -> DemoResult:
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives import BD3LMObjective

    if cfg.steps <= 0:
        raise ValueError(f"--steps must be positive, got {cfg.steps}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    t0 = time.time()
    init_single_rank()
    torch.manual_seed(cfg.seed)
    tokenizer, train_rows, eval_rows, entropy = prepare_data(cfg)
    log(f"corpus: {len(train_rows)} train / {len(eval_rows)} held-out sequences of {cfg.seq_length} tokens, "
        f"vocab {tokenizer.vocab_size}, block size {cfg.block_size}")
    log(f"unigram entropy of the training tokens: {entropy:.4f} nats/token")

    layout = SequenceLayout(BlockGeometry(cfg.seq_length, cfg.block_size))
    objective = BD3LMObjective(cfg.block_size, tokenizer.mask_token_id, seed=cfg.seed, eps_min=cfg.noise_eps_min,
                               eps_max=cfg.noise_eps_max, loss_weighting=cfg.loss_weighting)
    nelbo = BD3LMObjective(cfg.block_size, tokenizer.mask_token_id, seed=cfg.seed)  # eval: full schedule, 1/t
    gpt = build_gpt(cfg, tokenizer.vocab_size, device)
    model = BlockDiffusionModel(gpt, objective, layout)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: megatron-core GPTModel, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{n_params / 1e6:.2f}M parameters, device {device}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)

    result = DemoResult(unigram_entropy=entropy, train_losses=[], train_rows=len(train_rows),
                        eval_rows=len(eval_rows))
    order = torch.Generator().manual_seed(cfg.seed)
    perm, cursor = torch.randperm(len(train_rows), generator=order), 0
    t_train = time.time()
    for step in range(cfg.steps):
        if cursor + cfg.batch_size > len(perm):  # next epoch
            perm, cursor = torch.randperm(len(train_rows), generator=order), 0
        idx = perm[cursor : cursor + cfg.batch_size]
        cursor += cfg.batch_size
        tokens = train_rows[idx].to(device)
        loss_mask = torch.ones_like(tokens)
        # Noise is keyed by the sample's position in the training stream: a revisited row gets
        # fresh noise, and the same step draws the same noise whatever the parallel layout.
        sample_index = torch.arange(step * cfg.batch_size, (step + 1) * cfg.batch_size)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        out = model(tokens, loss_mask, sample_index)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        loss = float(out.loss.detach())
        if not math.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss} at step {step + 1}")
        result.train_losses.append(loss)
        last = step + 1 == cfg.steps
        if cfg.eval_interval and ((step + 1) % cfg.eval_interval == 0 or last):
            result.eval_steps.append(step + 1)
            result.eval_losses.append(evaluate(model, eval_rows, cfg, device, nelbo))
        if cfg.log_interval and ((step + 1) % cfg.log_interval == 0 or last or step == 0):
            window = result.train_losses[-cfg.log_interval:]
            rate = (step + 1) / (time.time() - t_train)
            line = (f"step {step + 1:4d}/{cfg.steps} | loss {loss:7.4f} | avg {sum(window) / len(window):7.4f} "
                    f"| lr {lr_at(step, cfg):.2e} | {rate:5.2f} steps/s")
            if result.eval_steps and result.eval_steps[-1] == step + 1:
                line += f" | eval {result.eval_losses[-1]:7.4f}"
            log(line)
    if not result.eval_steps or result.eval_steps[-1] != cfg.steps:
        result.eval_steps.append(cfg.steps)
        result.eval_losses.append(evaluate(model, eval_rows, cfg, device, nelbo))
    tail = result.train_losses[-max(1, min(cfg.log_interval, len(result.train_losses))):]
    result.final_train_objective = sum(tail) / len(tail)
    # The train NELBO with the eval estimator, on as many training rows as there are eval rows.
    result.final_train_loss = evaluate(model, train_rows[: max(len(eval_rows), cfg.batch_size)], cfg, device, nelbo)
    result.final_eval_loss = result.eval_losses[-1]
    result.seconds = time.time() - t0

    log(f"unigram entropy:  {entropy:.4f} nats/token")
    log(f"final train loss: {result.final_train_loss:.4f} nats/token (BD3-LM NELBO on training rows; "
        f"training objective, mean of last {len(tail)} steps: {result.final_train_objective:.4f})")
    log(f"final eval loss:  {result.final_eval_loss:.4f} nats/token (BD3-LM NELBO, held-out, upper bound on NLL)")
    log(f"time: {result.seconds:.1f} s")
    if cfg.output_dir:
        os.makedirs(cfg.output_dir, exist_ok=True)
        result.plot_path = plot_losses(
            result, os.path.join(cfg.output_dir, "loss_curve.png"),
            f"BD3-LM on pydoc topics: L={cfg.seq_length}, B={cfg.block_size}, {cfg.num_layers}x{cfg.hidden_size}")
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
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
