"""`python -m megatron_csbp.train`: Megatron-core training of a block diffusion LM.

One iteration: the global batch is split into micro-batches by Megatron-LM's sampler arithmetic
(global sample indices); the loss denominator is the supervised-token count of the whole global
batch (summed over micro-batches and data-parallel ranks); Megatron's no-pipelining schedule runs
forward/backward with `calculate_per_token_loss` (no averaging: each rank's loss is already its
share of the global mean); Megatron's DDP sums gradients over DP x CP x BP (`dp_cp`, which holds the
block-parallel ranks); the Megatron optimizer clips by global norm and steps; the scheduler
advances by the global batch.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist


def _log0(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def init_distributed(args):
    if not dist.is_initialized():
        backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    if dist.get_world_size() != args.world_size:
        raise RuntimeError(f"WORLD_SIZE {args.world_size} at parse time, {dist.get_world_size()} at init")
    from megatron_csbp.compat.cpu import install_cpu_compat
    install_cpu_compat()
    from megatron_csbp import parallel_state as bps
    if not bps.is_initialized():
        bps.initialize_block_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                      args.context_parallel_size, args.block_parallel_size,
                                      args.expert_model_parallel_size)


def device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# FLOPs on the block-diffusion mask's real work
# ----------------------------------------------------------------------------------------------
def attention_pairs(seq_length: int, block_size: int, clean_attention: str, objective: str) -> int:
    """Allowed query-key pairs of one sample (one view): the objective's FLOPs term
    (`Objective.attention_pairs`), e.g. L*(L+B) for block-causal BD3-LM."""
    from megatron_csbp.objectives import objective_class

    return objective_class(objective).attention_pairs(seq_length, block_size, clean_attention)


def flops_per_sample(args) -> float:
    """Forward + backward FLOPs of one sample, counting the logical (not replicated) work. A dense
    estimate: MoE models (DiffusionGemma) count their dense MLP only; the rows and attention pairs
    are the objective's (`Objective.rows_per_sample`, `views`, `attention_pairs`): diffusiongemma-sft
    counts a canvas over the whole sequence (an upper bound: prompt blocks have no canvas)."""
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
    attn = 4 * views * attention_pairs(L, args.block_size, args.clean_attention, args.objective) * heads * d * layers
    logits = 2 * views * L * h * args.vocab_size
    return 3.0 * (linear + attn + logits)


# ----------------------------------------------------------------------------------------------
def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: kB


def _allreduce(values: List[float], op=dist.ReduceOp.SUM, group=None) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device() if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


class Setup:
    """Everything main() builds: model, DDP, optimizer, scheduler, datasets."""


def build(args) -> Setup:
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_csbp.training.arguments import model_args
    from megatron_csbp.training.model import build_model

    s = Setup()
    s.args = args

    def finalize(model_chunks, num_tokens=None, **kwargs):
        # Losses are pre-divided by the global denominator: no per-token rescaling here.
        return finalize_model_grads(model_chunks, None, **kwargs)

    model = build_model(model_args(args), device=device(), finalize_model_grads_func=finalize)
    s.model = model
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=args.use_distributed_optimizer)
    s.ddp = DistributedDataParallel(model.config, ddp_config, model)
    model.config.no_sync_func = s.ddp.no_sync
    opt_config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                 adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                                 clip_grad=args.clip_grad, bf16=args.bf16,
                                 params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                                 use_distributed_optimizer=args.use_distributed_optimizer)
    s.optimizer = get_megatron_optimizer(opt_config, [s.ddp])
    G = args.global_batch_size
    decay_iters = args.lr_decay_iters or args.train_iters
    s.scheduler = OptimizerParamScheduler(
        s.optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * G, lr_decay_steps=max(decay_iters * G, args.lr_warmup_iters * G + 1),
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=max(decay_iters * G, 1), wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False)
    s.dp_rank = mpu.get_data_parallel_rank()
    s.dp_size = mpu.get_data_parallel_world_size()
    s.dp_group = mpu.get_data_parallel_group()
    s.dp_cp_group = mpu.get_data_parallel_group(with_context_parallel=True)
    s.train_ds, s.valid_ds = build_datasets(args)
    s.flops_per_sample = flops_per_sample(args)
    s.eval_objective = eval_objective(args, model.bdlm.objective)
    return s


def eval_objective(args, train_objective):
    """The objective evaluation uses: `train_objective.for_evaluation()` (BD3-LM: always the NELBO,
    t ~ U[1e-3, 1] with 1/t weights, whatever schedule training draws from, so held-out losses of
    runs with different training schedules compare; other objectives: the training objective)."""
    return train_objective.for_evaluation()


def build_datasets(args):
    """(train, valid) datasets of the objective's kind (`Objective.build_datasets`)."""
    from megatron_csbp.objectives import objective_class

    return objective_class(args.objective).build_datasets(args)


# ----------------------------------------------------------------------------------------------
def run_batches(s: Setup, dataset, consumed: int, forward_only: bool):
    """Forward(/backward) of one global batch starting at `consumed`; returns the global loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_csbp.data.megatron_data import collate, microbatch_indices

    args = s.args
    dev = device()
    batches = []
    local_den = 0.0
    objective = s.model.bdlm.objective
    for j in range(args.num_microbatches):
        idx = microbatch_indices(consumed, j, args.micro_batch_size, s.dp_rank, s.dp_size)
        b = collate(dataset, idx, dev)
        batches.append(b)
        local_den += float(objective.denominator(b["loss_mask"]))
    (den,) = _allreduce([local_den], group=s.dp_group)
    if den <= 0:
        raise RuntimeError(f"global batch at sample {consumed} has no supervised tokens")
    denominator = torch.tensor(den, dtype=torch.float32, device=dev)
    partial_losses = []

    def loss_func(out, output_tensor):
        partial_losses.append(out.loss.detach().float())
        return output_tensor, out.num_targets.to(torch.int), {}

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["loss_mask"], b["sample_index"], denominator)
        return out.loss, partial(loss_func, out)

    fb = get_forward_backward_func()
    fb(forward_step_func=forward_step, data_iterator=iter(batches), model=[s.ddp],
       num_microbatches=args.num_microbatches, seq_length=args.seq_length,
       micro_batch_size=args.micro_batch_size, forward_only=forward_only)
    local = float(torch.stack(partial_losses).sum()) if partial_losses else 0.0
    (loss,) = _allreduce([local], group=s.dp_cp_group)
    return loss


def train_step(s: Setup, consumed: int):
    s.ddp.zero_grad_buffer()
    s.optimizer.zero_grad()
    loss = run_batches(s, s.train_ds, consumed, forward_only=False)
    ok, grad_norm, _ = s.optimizer.step()
    s.scheduler.step(increment=s.args.global_batch_size)
    return loss, (float(grad_norm) if grad_norm is not None else float("nan")), ok


def evaluate(s: Setup) -> float:
    """Mean loss over the first `--eval-iters` global batches of the held-out split, with
    `eval_objective`. Every evaluation reads the same samples with the same noise (keyed by the
    held-out sample index), so successive evaluations differ only by the model."""
    args = s.args
    bdlm = s.model.bdlm
    train_objective = bdlm.objective
    bdlm.objective = s.eval_objective
    s.ddp.eval()
    losses = []
    try:
        with torch.no_grad():
            for k in range(args.eval_iters):
                losses.append(run_batches(s, s.valid_ds, k * args.global_batch_size, forward_only=True))
    finally:
        bdlm.objective = train_objective
        s.ddp.train()
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------------------------
def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class Logger:
    def __init__(self, args, start_iteration: int = 0):
        self.args = args
        self.rank = dist.get_rank()
        self.last = dist.get_world_size() - 1
        self.json_path = args.log_json
        self.tb = None
        if args.tensorboard_dir and self.rank == self.last:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir=args.tensorboard_dir)
        self.bar = None
        if self.rank == 0 and not args.no_progress_bar and sys.stderr.isatty():
            # tqdm on stderr: iterations done, rate and ETA; log lines are written above it.
            from tqdm import tqdm
            self.bar = tqdm(total=args.train_iters, initial=start_iteration, desc="train", dynamic_ncols=True,
                            leave=False)

    def write(self, rec: Dict):
        args = self.args
        if self.tb is not None:
            it = rec["iteration"]
            for key in ("loss", "grad_norm", "lr", "tokens_per_second", "attn_comm_bytes", "peak_memory_bytes",
                        "tflops_per_gpu", "eval_loss"):
                if rec.get(key) is not None:
                    self.tb.add_scalar(key.replace("loss", "lm loss") if key == "loss" else key, rec[key], it)
            self.tb.flush()
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


def train(s: Setup) -> Dict:
    from megatron_csbp.attention.accounting import traffic_counter
    from megatron_csbp.training import checkpointing

    args = s.args
    iteration, consumed = 0, 0
    if args.load:
        info = checkpointing.load_checkpoint(args.load, s.model, s.optimizer, s.scheduler, args.ckpt_step)
        if info is None and getattr(args, "model_shape", None) is not None:
            raise RuntimeError(f"--load {args.load} has a model shape file but no checkpoint to load")
        if info is not None and info.get("release"):
            _log0(f" loaded converted model {info['path']} (release: weights only, iteration 0, fresh optimizer)")
        elif info is not None:
            iteration, consumed = info["iteration"], info["consumed_samples"]
            _log0(f" loaded checkpoint {info['path']} (iteration {iteration}, consumed samples {consumed})")
        else:
            _log0(f" no checkpoint in --load {args.load}: starting from scratch")
    logger = Logger(args, iteration)
    history = []
    world = dist.get_world_size()
    tokens_per_iter = args.global_batch_size * args.seq_length

    if args.skip_train:
        ev = evaluate(s)
        rec = {"iteration": iteration, "eval_loss": ev}
        logger.write(rec)
        history.append(rec)
        logger.close()
        return {"history": history, "iteration": iteration}

    if args.save and args.save_initial and iteration == 0:
        checkpointing.save_checkpoint(args.save, 0, s.model, s.optimizer, s.scheduler, 0,
                                      extra=checkpoint_extra(args), **_shape_files(args))
        _log0(f" saved the initial (untrained) weights as iteration 0 to {args.save}")
    acc_time, acc_iters = 0.0, 0
    stop_at = args.train_iters if args.exit_interval is None else min(args.train_iters, args.exit_interval)
    start_iteration, wall_start = iteration, time.perf_counter()
    train_losses = []  # (iteration, loss) of every step, for plots
    while iteration < stop_at:
        traffic_counter().reset()
        t0 = time.perf_counter()
        loss, grad_norm, ok = train_step(s, consumed)
        dt = time.perf_counter() - t0
        iteration += 1
        consumed += args.global_batch_size
        train_losses.append((iteration, loss))
        acc_time += dt
        acc_iters += 1
        logger.step()
        do_log = iteration % args.log_interval == 0 or iteration == stop_at or iteration == 1
        do_eval = bool(args.eval_interval and args.eval_iters and iteration % args.eval_interval == 0)
        if do_log or do_eval:
            comm, mem, ms = _allreduce([float(traffic_counter().total), float(peak_memory_bytes()), acc_time],
                                       op=dist.ReduceOp.MAX)
            per_iter = ms / max(acc_iters, 1)
            rec = {"iteration": iteration, "consumed_samples": consumed, "loss": loss, "grad_norm": grad_norm,
                   "lr": s.optimizer.param_groups[0]["lr"], "ms_per_iteration": 1000.0 * per_iter,
                   "tokens_per_second": tokens_per_iter / per_iter,
                   "tflops_per_gpu": s.flops_per_sample * args.global_batch_size / per_iter / world / 1e12,
                   "attn_comm_bytes": int(comm), "peak_memory_bytes": int(mem), "skipped": not ok}
            if do_eval:
                rec["eval_loss"] = evaluate(s)
            # Remaining time at the mean pace so far (training, evaluation and checkpoints included).
            pace = (time.perf_counter() - wall_start) / (iteration - start_iteration)
            rec["eta_seconds"] = pace * (stop_at - iteration)
            logger.write(rec)
            history.append(rec)
            acc_time, acc_iters = 0.0, 0
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            checkpointing.save_checkpoint(args.save, iteration, s.model, s.optimizer, s.scheduler, consumed,
                                          extra=checkpoint_extra(args), **_shape_files(args))
            _log0(f" saved checkpoint at iteration {iteration} to {args.save}")
    if args.save and not (args.save_interval and iteration % args.save_interval == 0) and iteration > 0:
        checkpointing.save_checkpoint(args.save, iteration, s.model, s.optimizer, s.scheduler, consumed,
                                      extra=checkpoint_extra(args), **_shape_files(args))
        _log0(f" saved checkpoint at iteration {iteration} to {args.save}")
    logger.close()
    return {"history": history, "iteration": iteration, "consumed_samples": consumed, "train_losses": train_losses}


def _shape_files(args) -> Dict:
    """A converted model's shape file and Hugging Face assets travel into every saved checkpoint."""
    shape = getattr(args, "model_shape", None)
    if shape is None:
        return {}
    from megatron_csbp.training.checkpointing import ASSETS_DIR
    return {"shape": shape, "assets_from": os.path.join(args.load, ASSETS_DIR)}


def checkpoint_extra(args) -> Dict:
    """Model hyper-parameters saved with the checkpoint (generate rebuilds the model from them)."""
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "seq_length",
            "vocab_size", "make_vocab_size_divisible_by", "block_size", "objective", "mask_token_id",
            "clean_attention", "normalization", "swiglu", "untie_embeddings_and_output_weights", "rotary_base",
            "tokenizer_type", "tokenizer_model", "eod_token_id", "noise_eps_min", "noise_eps_max",
            "loss_weighting", "seed", "init_method_std")
    return {"model_args": {k: getattr(args, k, None) for k in keys}}


def objective_of(argv: List[str]) -> Optional[str]:
    """The value of --objective in argv (either spelling), or None."""
    for i, a in enumerate(argv):
        if a == "--objective" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--objective="):
            return a.split("=", 1)[1]
    return None


def own_trainer(argv: List[str]):
    """The entry point `run(argv)` of the trainer of the objective argv names, when that objective
    trains in a loop of its own (`Objective.own_trainer`, e.g. dflash on captured verifier features);
    None when this trainer trains it (or argv names no registered objective: the parser says so)."""
    from megatron_csbp.objectives.registry import registered_objectives

    cls = registered_objectives().get(objective_of(argv) or "")
    return cls.run_trainer if cls is not None and cls.own_trainer is not None else None


def main(argv: Optional[List[str]] = None) -> Dict:
    from megatron_csbp.training.arguments import parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    demo = not argv
    start = time.time()
    if demo:
        from megatron_csbp.training.demo import prepare_demo
        argv = prepare_demo(int(os.environ.get("WORLD_SIZE", "1")))
    if objective_of(argv) == "dflash":
        # The drafter trains on captured verifier features, not on token datasets: its own loop.
        from megatron_csbp import dflash
        return dflash.main(["train"] + argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    args = parse_args(argv)
    init_distributed(args)
    try:
        s = build(args)
        _log0(f" > block diffusion training: world {args.world_size} = TP {args.tensor_model_parallel_size} x "
              f"CP {args.context_parallel_size} / BP {args.block_parallel_size} (layout {s.model.bdlm.layout.kind}) x "
              f"DP {args.data_parallel_size}; {sum(p.numel() for p in s.model.parameters())} parameters per rank; "
              f"objective {args.objective}; {args.num_microbatches} micro-batches per iteration")
        result = train(s)
    finally:
        from megatron_csbp import parallel_state as bps
        if bps.is_initialized():
            bps.destroy_block_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    if demo:
        from megatron_csbp.training.demo import finish_demo
        finish_demo(args, result, time.time() - start)
    return result
