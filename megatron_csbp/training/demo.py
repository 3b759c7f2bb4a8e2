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

The exact equivalent command is printed at start (and written to `runs/default/command.txt`). Every
flag is checked before anything is written; an earlier run is never deleted: a later one writes
`runs/default-2/` (then `-3`, ...) and says so.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_csbp.data import DEFAULT_CORPUS, unigram_entropy

RUN_DIR = os.environ.get("MEGATRON_CSBP_DEMO_DIR", os.path.join("runs", "default"))
#: what a run leaves in its folder (the preprocessed data/ and command.txt are written before it starts)
RUN_OUTPUTS = ("checkpoints", "tensorboard", "log.jsonl", "loss_curve.png", "sample.txt", "summary.json")
_run_dir: Optional[str] = None
TRAIN_ITERS = int(os.environ.get("MEGATRON_CSBP_DEMO_ITERS", "600"))
#: held-out evaluations over the run (every TRAIN_ITERS / EVALS iterations)
EVALS = 6


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
    eval_repeats: int = 2  # passes over the held-out rows, fresh noise each (the NELBO is a Monte-Carlo estimate)
    max_eval_rows: Optional[int] = None
    log_interval: int = 25
    # One intra-op thread by default: the matrices are small, and on shared CPUs extra threads
    # mostly spin. Raise it on an idle many-core machine.
    threads: Optional[int] = 1
    corpus: Optional[str] = None
    tokenizer: Optional[str] = None
    output_dir: Optional[str] = "runs/demo"


def split(cfg: DemoConfig) -> str:
    """Megatron's --split holding out the last `eval_fraction` of the documents (percent: 90,10,0)."""
    return f"{100 - round(100 * cfg.eval_fraction)},{round(100 * cfg.eval_fraction)},0"


def trainer_flags(cfg: DemoConfig, prefix: str, eval_iters: int) -> List[str]:
    """The trainer's flags for this model, schedule and data (the embedded default run's too,
    `demo_argv`) and `python -m megatron_csbp.demo`'s."""
    flags = dict(data_path=prefix, split=split(cfg),
                 tokenizer_type="SentencePieceTokenizer", tokenizer_model=cfg.tokenizer, seq_length=cfg.seq_length,
                 block_size=cfg.block_size, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                 num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
                 ffn_hidden_size=cfg.ffn_hidden_size, init_method_std=cfg.init_method_std,
                 noise_eps_min=cfg.noise_eps_min, noise_eps_max=cfg.noise_eps_max, loss_weighting=cfg.loss_weighting,
                 micro_batch_size=cfg.batch_size, global_batch_size=cfg.batch_size, train_iters=cfg.steps,
                 lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_iters=cfg.warmup_steps, lr_decay_style="cosine",
                 adam_beta2=0.95, weight_decay=cfg.weight_decay, clip_grad=cfg.clip_grad, seed=cfg.seed,
                 eval_iters=eval_iters)
    argv = [x for k, v in flags.items() if v is not None for x in (f"--{k.replace('_', '-')}", str(v))]
    return argv + (["--qk-layernorm"] if cfg.qk_layernorm else [])


def run_dir() -> str:
    """This run's folder: RUN_DIR, else the first of RUN_DIR-2, RUN_DIR-3, ... that holds no earlier
    run's outputs. Every rank decides before it joins the process group, and the outputs appear
    only after every rank joined, so all ranks pick the same folder."""
    global _run_dir
    if _run_dir is None:
        n, path = 1, RUN_DIR
        while any(os.path.exists(os.path.join(path, name)) for name in RUN_OUTPUTS):
            n += 1
            path = f"{RUN_DIR}-{n}"
        _run_dir = path
    return _run_dir


def demo_argv(world_size: int, prefix: str) -> List[str]:
    """The embedded run's flags. The model, schedule and held-out split are the single-rank demo's
    (`python -m megatron_csbp.demo`, `demo.trainer_flags`): 2 layers, hidden 128, 2 heads, SwiGLU
    512, init std 0.05, 8 sequences per step, Adam 2e-3 -> 2e-4 cosine after 20 warmup steps, and
    training block times drawn from the clipped range [0.3, 0.8] (BD3-LM's clipped schedule cuts the
    variance of the 1/t weights); evaluation always reports the full-schedule NELBO on the same
    held-out batches (8 of them)."""
    seq = max(1, world_size)
    return trainer_flags(DemoConfig(steps=TRAIN_ITERS), prefix, eval_iters=8) + [
        "--context-parallel-size", str(seq), "--block-parallel-size", str(seq),
        "--save", os.path.join(run_dir(), "checkpoints"), "--save-interval", str(TRAIN_ITERS), "--save-initial",
        "--eval-interval", str(max(1, TRAIN_ITERS // EVALS)), "--log-interval", str(max(1, TRAIN_ITERS // 12)),
        "--tensorboard-dir", os.path.join(run_dir(), "tensorboard"),
        "--log-json", os.path.join(run_dir(), "log.jsonl"),
        "--data-cache-path", os.path.join(run_dir(), "data", "cache"),
    ]


def prepare_demo(world_size: int) -> List[str]:
    """The run's flags, checked (the data, not yet there, aside) before the data is prepared."""
    from megatron_csbp.training.arguments import build_parser, validate_args

    rank = int(os.environ.get("RANK", "0"))
    data_dir = os.path.join(run_dir(), "data")
    prefix = os.path.join(data_dir, "pydoc_text_document")
    done = prefix + ".done"
    argv = demo_argv(world_size, prefix)
    args = build_parser().parse_args(argv)
    args.placeholders = {"data_path"}
    validate_args(args, world_size, check_only=True)  # e.g. a world size the layout cannot split the sequence for
    if rank == 0:
        if run_dir() != RUN_DIR:
            print(f" > {RUN_DIR} holds an earlier run (kept): this run writes {run_dir()}", flush=True)
        if not os.path.exists(done):
            from megatron_csbp.data.preprocess import main as preprocess
            os.makedirs(data_dir, exist_ok=True)
            preprocess(["--input", "shipped", "--output-prefix", os.path.join(data_dir, "pydoc"), "--append-eod"])
            with open(done, "w") as f:
                f.write("ok\n")
        cmd = f"torchrun --nproc-per-node {world_size} -m megatron_csbp.train " + " ".join(argv)
        with open(os.path.join(run_dir(), "command.txt"), "w") as f:
            f.write(cmd + "\n")
        print(f" > embedded demo (no flags given); equivalent command:\n   {cmd}", flush=True)
    else:
        # Rank 0 joins the process group only after preparing; waiting for the file is enough.
        deadline = time.time() + 600
        while not os.path.exists(done):
            if time.time() > deadline:
                raise RuntimeError(f"rank {rank}: rank 0 did not prepare {done}")
            time.sleep(0.5)
    return argv


def ema(values: List[float], decay: float = 0.95) -> List[float]:
    """Exponential moving average, bias-corrected (the first points are not pulled towards 0)."""
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        acc = decay * acc + (1 - decay) * v
        norm = decay * norm + (1 - decay)
        out.append(acc / norm)
    return out


def corpus_unigram_entropy(prefix: str) -> float:
    """Entropy (nats/token) of the unigram distribution of the preprocessed corpus: the loss of the
    best model that ignores context, for scale."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    tokens = np.concatenate([ds[i] for i in range(len(ds))])
    return unigram_entropy([tokens], int(tokens.max()) + 1)


def eval_points(history: List[Dict]) -> List[Tuple[int, float]]:
    """(iteration, held-out loss) of the logged records that hold an evaluation."""
    return [(h["iteration"], h["eval_loss"]) for h in history if h.get("eval_loss") is not None]


def plot_losses(train_losses: List, evals: List[Tuple[int, float]], path: str, entropy: float = None,
                title: str = "block diffusion LM (BD3-LM), CSBP on 2 CPU ranks") -> None:
    """(iteration, loss) per step with its EMA, the held-out NELBO points `evals`, the entropy line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train_losses:
        it, loss = zip(*train_losses)
        ax.plot(it, loss, color="tab:blue", alpha=0.2, lw=0.7, label="train objective (per step)")
        ax.plot(it, ema(list(loss)), color="tab:blue", lw=1.8, label="train objective (EMA 0.95)")
    if evals:
        ax.plot(*zip(*evals), "o-", color="tab:red", label="held-out NELBO")
    if entropy is not None:
        ax.axhline(entropy, color="k", ls="--", lw=1, label=f"unigram entropy {entropy:.2f}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("nats/token")
    ax.set_ylim(3.5, 8.0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: the default run's samples: (prompt, `python -m megatron_csbp.generate` flags besides --load/--ckpt-step/--prompt)
SAMPLE_PROMPT = "The for statement is used to"
SAMPLE_FLAGS = ["--max-new-tokens", "48", "--temperature", "0.8", "--unmask-order", "random", "--seed", "1"]


def finish_demo(args, result: Dict, wall_seconds: float, sample: Optional[Callable[[List[str]], str]] = None) -> None:
    """Rank 0, after the process groups are gone: plot, summary, samples before and after training
    (`sample(generate_argv) -> text`, given by the app that decodes: `generation.decode.sample_text`)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    hist, evals = result["history"], eval_points(result["history"])
    png = os.path.join(run_dir(), "loss_curve.png")
    entropy = corpus_unigram_entropy(args.data_path[-1])
    plot_losses(result.get("train_losses", []), evals, png, entropy)
    losses = [h["loss"] for h in hist if "loss" in h]
    comm = [h["attn_comm_bytes"] for h in hist if "attn_comm_bytes" in h]
    summary = {"wall_seconds": round(wall_seconds, 1), "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "last_eval_loss": evals[-1][1] if evals else None,
               "eval_losses": {str(i): v for i, v in evals}, "unigram_entropy": entropy,
               "attn_comm_bytes_per_iteration": comm[-1] if comm else None, "iterations": result["iteration"]}
    with open(os.path.join(run_dir(), "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    curve = " -> ".join(f"{v:.3f}" for _, v in evals)
    print(f" > demo done in {wall_seconds:.0f} s; held-out NELBO (nats/token) at iterations "
          f"{', '.join(str(i) for i, _ in evals)}: {curve} (unigram entropy of the corpus {entropy:.3f}); "
          f"attention traffic per iteration (busiest rank) {summary['attn_comm_bytes_per_iteration']} bytes; "
          f"plot {png}", flush=True)
    if sample is None:
        return
    before, after = (sample(["--load", args.save, "--ckpt-step", str(step), "--prompt", SAMPLE_PROMPT] + SAMPLE_FLAGS)
                     for step in (0, result["iteration"]))
    text = (f" > samples (python -m megatron_csbp.generate --load {args.save} --ckpt-step N --prompt '{SAMPLE_PROMPT}' "
            f"--temperature 0.8 --unmask-order random --seed 1):\n"
            f"--- untrained (iteration 0) ---\n{before}\n"
            f"--- trained (iteration {result['iteration']}) ---\n{after}")
    print(text, flush=True)
    with open(os.path.join(run_dir(), "sample.txt"), "w") as f:
        f.write(text + "\n")


# ---- python -m megatron_csbp.demo: one rank, in this process -----------------------------------
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
    from megatron.core.datasets.indexed_dataset import IndexedDataset

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
    """`python -m megatron_csbp.demo`: the demo model trained by `Trainer.train` on one rank, then the
    NELBO on the held-out and (as many) training rows against the unigram entropy; plot and metrics."""
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
    eval_iters = cfg.eval_repeats * max(1, math.ceil(eval_rows / cfg.batch_size))
    argv = trainer_flags(cfg, prefix, eval_iters) + ["--data-cache-path", os.path.join(data_dir, "cache"),
                                                     "--log-interval", str(cfg.log_interval or cfg.steps)]
    run = parse_args(argv + (["--eval-interval", str(cfg.eval_interval)] if cfg.eval_interval else []), world_size=1)
    if mpu.model_parallel_is_initialized() and not bps.is_initialized():
        mpu.destroy_model_parallel()  # Megatron's groups alone (init_single_rank): the trainer makes its own
    trainer = Trainer(TrainerConfig.from_args(run)).build()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    log(f"model: megatron-core GPTModel, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{n_params / 1e6:.2f}M parameters, device {next(trainer.model.parameters()).device}")
    trained = trainer.train()  # a non-finite loss stops the trainer (TrainingStopped)
    evals = eval_points(trained["history"])
    if not evals or evals[-1][0] != cfg.steps:
        evals.append((cfg.steps, trainer.evaluate()))
    losses = [loss for _, loss in trained["train_losses"]]
    tail = losses[-max(1, min(cfg.log_interval, len(losses))):]
    # final_train_loss: the train NELBO with the eval estimator, on as many training batches as held-out ones
    result = DemoResult(entropy, losses, [i for i, _ in evals], [v for _, v in evals],
                        final_train_loss=trainer.evaluate(trainer.train_ds),
                        final_train_objective=sum(tail) / len(tail), final_eval_loss=evals[-1][1],
                        train_rows=train_rows, eval_rows=eval_rows, seconds=time.time() - t0)

    log(f"step {cfg.steps:4d}/{cfg.steps} | loss {result.train_losses[-1]:7.4f} | avg {result.final_train_objective:7.4f}"
        f" | eval {result.final_eval_loss:7.4f}")
    log(f"unigram entropy:  {entropy:.4f} nats/token")
    log(f"final train loss: {result.final_train_loss:.4f} nats/token (BD3-LM NELBO on training rows; "
        f"training objective, mean of last {len(tail)} steps: {result.final_train_objective:.4f})")
    log(f"final eval loss:  {result.final_eval_loss:.4f} nats/token (BD3-LM NELBO, held-out, upper bound on NLL)")
    log(f"time: {result.seconds:.1f} s")
    if cfg.output_dir:
        os.makedirs(cfg.output_dir, exist_ok=True)
        result.plot_path = os.path.join(cfg.output_dir, "loss_curve.png")
        plot_losses(trained["train_losses"], evals, result.plot_path, entropy,
                    f"BD3-LM on one rank: L={cfg.seq_length}, B={cfg.block_size}, {cfg.num_layers}x{cfg.hidden_size}")
        with open(os.path.join(cfg.output_dir, "metrics.json"), "w") as f:
            json.dump({"config": asdict(cfg), "result": asdict(result)}, f, indent=1)
        log(f"wrote {result.plot_path} and metrics.json")
    return result
