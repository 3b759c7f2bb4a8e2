"""`Trainer`: Megatron-core training of a block diffusion LM over one typed config.

    trainer = Trainer(TrainerConfig.from_args(parse_args(argv)))
    with trainer:                      # build() on entry (process groups too), close() on exit
        result = trainer.train()       # load -> [train_step, evaluate, save]* -> final save

One iteration, the loss normalisation and the NaN checks: docs/training.md ("What runs", "Failing
loudly"); the path of one step: docs/architecture.md#one-training-step.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, fields
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_csbp.data.megatron_data import MicroBatchSampler, collate, microbatch_indices, train_batches
from megatron_csbp.lora import LoRAConfig, is_adapter
from megatron_csbp.model.assemble import params_dtype, wrap
from megatron_csbp.model.contract import Metrics
from megatron_csbp.objectives import objective_class
from megatron_csbp.parallel import pipeline
from megatron_csbp.parallel.self_conditioning import relay_for
from megatron_csbp.training.config import TrainerConfig
from megatron_csbp.training.metrics import Logger, allreduce, flops_per_sample, peak_memory_bytes
from megatron_csbp.training.model import TrainableBDLM, build_model_chunks
# (PROGRAM_START: --exit-duration-in-mins counts from this import)
from megatron_csbp.training.signals import PROGRAM_START, ExitConditions, ExitSignal, exit_signals  # noqa: F401
from megatron_csbp.utils.cli import CliError


class TrainingStopped(CliError):
    """The run cannot go on (a non-finite loss or gradient norm); the message names the iteration."""


def _log0(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(parallel) -> None:
    """torch.distributed (nccl with CUDA, else gloo), the compat layer, Megatron's and the plugin's
    process groups. `parallel`: a `ParallelConfig` (or a namespace with the same fields)."""
    if not dist.is_initialized():
        backend = parallel.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" not in os.environ and "MASTER_ADDR" not in os.environ:
            # `python -m megatron_csbp.train` without torchrun: one process, an in-memory store
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        elif os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and \
                os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun restarted this worker
            dist.init_process_group(backend, store=_attempt_store(), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        else:
            dist.init_process_group(backend)
    if dist.get_world_size() != parallel.world_size:
        raise RuntimeError(f"WORLD_SIZE {parallel.world_size} at parse time, {dist.get_world_size()} at init")
    from megatron_csbp.compat.cpu import install_compat
    install_compat()  # fixes for missing TE/apex on every device; the CPU relocation without CUDA
    from megatron_csbp.parallel import state as bps
    if not bps.is_initialized():
        bps.initialize_block_parallel(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                      parallel.context_parallel_size, parallel.block_parallel_size,
                                      parallel.expert_model_parallel_size, virtual_pipeline_model_parallel_size=(
                                          parallel.virtual_pipeline_model_parallel_size))


def _attempt_store():
    """torchrun (`--max-restarts`) keeps its agent's store across restarts and hands the workers the
    bare store, so a restarted gloo group read the peer addresses of the failed attempt ("Connection
    refused"). Each attempt gets keys of its own."""
    from datetime import timedelta

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"megatron_csbp/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def destroy_process_groups() -> None:
    """Tear down the plugin's and torch.distributed's process groups."""
    from megatron_csbp.parallel import state as bps
    if bps.is_initialized():
        bps.destroy_block_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class StepResult:
    loss: float  # the global batch's loss (its share summed over ranks)
    grad_norm: float
    ok: bool  # False when the optimizer skipped the step (non-finite gradients)


class Trainer:
    """Model, DDP, optimizer, scheduler and datasets of one run, and the steps that use them."""

    def __init__(self, config: TrainerConfig, gpt_provider: Optional[Callable] = None):
        """`gpt_provider(model_args) -> (TransformerConfig, GPTModel)`: a model the flags cannot build
        (the DiffusionGemma benchmark's), wrapped with the flags' objective and layout; no pipeline."""
        self.config = config
        self.gpt_provider = gpt_provider
        self.model = self.ddp = self.optimizer = self.scheduler = None
        self.chunks, self.ddps = [], []  # one per virtual pipeline stage (one without interleaving)
        self.sc_relay = None  # self-conditioning's first pass under pipeline parallelism
        self.train_ds = self.valid_ds = None
        self.iteration, self.consumed = 0, 0
        self.last_saved: Optional[int] = None  # iteration of the newest checkpoint this run saved or loaded
        self.lora = None  # the run's LoRAConfig (--lora-rank > 0): its checkpoints hold the adapters only
        self.base = None  # a LoRA run's --pretrained-checkpoint (lora.checkpoint.base_record), recorded by its saves
        self._batches, self._batches_at = None, None  # --num-workers: training micro-batches read ahead

    # ---- build -------------------------------------------------------------------------------
    def build(self) -> "Trainer":
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        c = self.config
        self.lora = LoRAConfig.of(c.model)
        init_distributed(c.parallel)

        def finalize(model_chunks, num_tokens=None, **kwargs):
            # Losses are pre-divided by the global denominator: no per-token rescaling here.
            return finalize_model_grads(model_chunks, None, **kwargs)

        # Pipeline parallelism: this rank's chunks (megatron_csbp/parallel/pipeline.py), one DDP each (Megatron-LM's
        # bucketing rule: only the first chunk is bucketed).
        if self.gpt_provider is None:
            self.chunks = build_model_chunks(c.model, device=device(), finalize_model_grads_func=finalize)
        else:
            config, gpt = self.gpt_provider(c.model)
            config.finalize_model_grads_func = finalize
            self.chunks = [TrainableBDLM(config, wrap(c.model, gpt, device=device()))]
        self.model = self.chunks[0] if len(self.chunks) == 1 else pipeline.ModelChunks(self.chunks)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=not c.optim.grad_reduce_in_bf16,
                                                   overlap_grad_reduce=c.parallel.overlap_grad_reduce,
                                                   overlap_param_gather=c.parallel.overlap_param_gather,
                                                   use_distributed_optimizer=c.parallel.use_distributed_optimizer)
        self.ddps = [DistributedDataParallel(ch.config, ddp_config, ch, disable_bucketing=i > 0)
                     for i, ch in enumerate(self.chunks)]
        self.ddp = self.ddps[0]
        no_sync = self.ddp.no_sync if len(self.ddps) == 1 else [d.no_sync for d in self.ddps]
        for ch in self.chunks:
            ch.config.no_sync_func = no_sync
            ch.config.variable_seq_lengths = pipeline.variable_rows(ch.objective)
        o = c.optim
        # every optim field megatron-core's OptimizerConfig has (lr, Adam's, clipping, loss scaling), by name
        shared = {f.name for f in fields(OptimizerConfig)} & {f.name for f in fields(o)}
        opt_config = OptimizerConfig(optimizer="adam", **{n: getattr(o, n) for n in shared},
                                     params_dtype=params_dtype(o),
                                     use_distributed_optimizer=c.parallel.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_config, self.ddps)
        if o.fp16:  # megatron-core's schedules scale the loss before backward (Megatron-LM sets the same)
            for ch in self.chunks:
                ch.config.grad_scale_func = self.optimizer.scale_loss
        G = c.batch.global_batch_size
        decay_iters = o.lr_decay_iters or c.batch.train_iters
        # Megatron's --lr-warmup-fraction: that fraction of the decay steps (samples), else --lr-warmup-iters
        warmup = o.lr_warmup_fraction * decay_iters * G if o.lr_warmup_fraction is not None else o.lr_warmup_iters * G
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=warmup, lr_decay_steps=max(decay_iters * G, warmup + 1),
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=max(decay_iters * G, 1), wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=c.checkpoint.use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler=c.checkpoint.override_opt_param_scheduler)
        self.dp_rank = mpu.get_data_parallel_rank()
        self.dp_size = mpu.get_data_parallel_world_size()
        self.dp_group = mpu.get_data_parallel_group()
        self.dp_cp_group = mpu.get_data_parallel_group(with_context_parallel=True)
        self.pp_group = mpu.get_pipeline_model_parallel_group() if mpu.get_pipeline_model_parallel_world_size() > 1 \
            else None
        self.sc_relay = relay_for(self.chunks, self.ddps)
        self.train_ds, self.valid_ds = objective_class(c.data.objective).build_datasets(c.data)
        self.flops_per_sample = flops_per_sample(c.model)
        # BD3-LM evaluates the NELBO whatever schedule training draws from; others their own objective
        self.eval_objective = self.chunks[0].objective.for_evaluation()
        if c.checkpoint.save:
            self._check_save_room()
        return self

    def _check_save_room(self) -> None:
        """Collective, before anything is trained or written: --save's file system has room for one
        checkpoint, estimated as parameters x (weight bytes + Adam's two fp32 moments + the fp32 main
        copy of bf16/fp16 weights)."""
        from megatron.core import parallel_state as mpu

        from megatron_csbp.checkpoint.files import CheckpointError, first_existing

        dp_cp = mpu.get_data_parallel_rank(with_context_parallel=True)
        expert_dp = mpu.get_expert_data_parallel_rank() if hasattr(mpu, "get_expert_data_parallel_rank") else dp_cp
        nbytes = 0.0
        for p in self.model.parameters():  # each weight counted on one replica (a LoRA run saves its adapters)
            if (self.lora is None or p.requires_grad) and (dp_cp if getattr(p, "allreduce", True) else expert_dp) == 0:
                nbytes += p.numel() * (p.element_size() + 8 + (4 if p.element_size() < 4 else 0))
        (nbytes,) = allreduce([nbytes])
        save = self.config.checkpoint.save
        verdict = [None]
        if dist.get_rank() == 0:
            free = shutil.disk_usage(first_existing(save)).free
            if free < nbytes:
                verdict[0] = (f"--save {save}: {free / 2**20:.1f} MiB free on its file system, a checkpoint of this "
                              f"model takes about {nbytes / 2**20:.1f} MiB (weights, Adam moments, fp32 main copy)")
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise CheckpointError(verdict[0])

    def describe(self) -> str:
        c = self.config
        return (f" > block diffusion training: {c.parallel.describe()}; "
                f"{sum(p.numel() for p in self.model.parameters())} parameters per rank; objective "
                f"{c.model.objective}; {c.batch.num_microbatches} micro-batches per iteration")

    # ---- steps -------------------------------------------------------------------------------
    def _run_batches(self, dataset, consumed: int, objective, metrics: Optional[List[Metrics]] = None) -> float:
        """Forward and backward of one global batch starting at `consumed` under `objective`, or with
        `metrics` (an evaluation's accumulator, a one-item list) forward only; returns the global loss."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        b_cfg = self.config.batch
        dev = device()
        batches = []
        local_den = 0.0
        prefetched = dataset is self.train_ds and self._batches is not None and self._batches_at == consumed
        for j in range(b_cfg.num_microbatches):
            if prefetched:  # --num-workers: the DataLoader's next micro-batch is this one
                b = {k: v.to(dev) for k, v in next(self._batches).items()}
            else:
                b = collate(dataset, microbatch_indices(consumed, j, b_cfg.micro_batch_size, self.dp_rank,
                                                        self.dp_size), dev)
            b["loss_mask"] = self.chunks[0].supervised(b["tokens"], b["loss_mask"])  # --eod-mask-loss
            batches.append(b)
            share = objective.denominator(b["loss_mask"], b["tokens"], b.get("document_ids"))
            local_den = local_den + share.detach().double().reshape(-1).cpu()  # a scalar or one per term
        if prefetched:
            self._batches_at += b_cfg.global_batch_size
        den = allreduce(local_den.tolist(), group=self.dp_group)
        if den[0] <= 0:
            raise RuntimeError(f"global batch at sample {consumed} has no supervised tokens")
        denominator = torch.tensor(den if len(den) > 1 else den[0], dtype=torch.float32, device=dev)
        partial_losses = []

        def loss_func(out, output_tensor):
            partial_losses.append(out.loss.detach().float())
            return output_tensor, out.num_targets.to(torch.int), {}

        def forward_step(data_iterator, model):
            b, chunk = next(data_iterator), model.module  # (model: the chunk's DDP)
            args = (b["tokens"], b["loss_mask"], b["sample_index"], denominator, b.get("document_ids"))
            # the first stage's self-conditioning input (parallel/self_conditioning.py), dropped once used
            sc = b.pop("self_conditioning", None)
            if not chunk.last_stage:  # a pipeline stage before the last: what the next one reads
                return chunk.stage_output(*args, sc, objective=objective), None
            if metrics is None:
                out = chunk.training_loss(*args, sc, objective=objective)
            else:
                out, metrics[0] = chunk.evaluation_loss(*args, objective=objective, metrics=metrics[0])
            return out.loss, partial(loss_func, out)

        fb = get_forward_backward_func()
        # Under pipeline parallelism P2P moves this rank's rows ([rows, b, h]): the schedule's
        # seq_length is the rank's row count x CP (it divides by CP, and by TP under SP).
        seq_length = pipeline.p2p_seq_length(self.chunks[0]) if self.pp_group is not None else b_cfg.seq_length
        if self.sc_relay is not None:  # self-conditioning's first pass through the stages (pipeline_self_conditioning)
            self.sc_relay.run(fb, batches, seq_length, b_cfg.micro_batch_size)
        data = iter(batches) if len(self.ddps) == 1 else [iter(batches) for _ in self.ddps]
        fb(forward_step_func=forward_step, data_iterator=data, model=self.ddps,
           num_microbatches=b_cfg.num_microbatches, seq_length=seq_length,
           micro_batch_size=b_cfg.micro_batch_size, forward_only=metrics is not None)
        local = float(torch.stack(partial_losses).sum()) if partial_losses else 0.0
        (loss,) = allreduce([local], group=self.dp_cp_group)
        if self.pp_group is not None:  # the loss lives on the last stage
            (loss,) = allreduce([loss], group=self.pp_group)
        return loss

    def train_step(self, consumed: int) -> StepResult:
        """One optimizer step on the global batch that starts at sample `consumed`."""
        for d in self.ddps:
            d.zero_grad_buffer()
        self.optimizer.zero_grad()
        check = self.config.optim.check_for_nan_in_loss_and_grad
        loss = self._run_batches(self.train_ds, consumed, self.chunks[0].objective)
        if check and not math.isfinite(loss):  # the global loss: every rank stops here together
            self._stop(consumed, f"the loss is {loss}", "before the optimizer step")
        ok, grad_norm, _ = self.optimizer.step()
        if grad_norm is None and ok:  # --clip-grad 0: the optimizer computed no norm; log (and check) it
            grad_norm = self.optimizer.get_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        if check and ok and not math.isfinite(grad_norm):
            self._stop(consumed, f"the gradient norm is {grad_norm}", "without saving the stepped weights")
        self.scheduler.step(increment=self.config.batch.global_batch_size)
        return StepResult(loss, grad_norm, ok)

    def _stop(self, consumed: int, what: str, when: str) -> None:
        iteration = consumed // self.config.batch.global_batch_size + 1
        ck = self.config.checkpoint
        last = (f"the latest checkpoint is iteration {self.last_saved} in {ck.save or ck.load}"
                if self.last_saved is not None else "no checkpoint was saved")
        raise TrainingStopped(f"iteration {iteration}: {what}; stopped {when} (--check-for-nan-in-loss-and-grad; "
                              f"{last}; try a lower --lr or --clip-grad > 0)")

    def evaluate(self, dataset=None) -> float:
        """Mean loss over the first `--eval-iters` global batches of the held-out split (or of
        `dataset`), with `eval_objective` (`evaluation`'s "eval_loss")."""
        return self.evaluation(dataset)["eval_loss"]

    def evaluation(self, dataset=None) -> Dict:
        """Collective: the record of one evaluation, "eval_loss" and what the model adds
        (`ModelChunk.eval_record`, e.g. the DFlash drafter's held-out acceptance). Every evaluation
        reads the same samples with the same noise (keyed by the held-out sample index), so
        successive evaluations differ only by the model."""
        for d in self.ddps:
            d.eval()
        losses, metrics = [], [{}]
        try:
            with torch.no_grad():
                for k in range(self.config.eval.eval_iters):
                    losses.append(self._run_batches(self.valid_ds if dataset is None else dataset,
                                                    k * self.config.batch.global_batch_size, self.eval_objective,
                                                    metrics))
        finally:
            for d in self.ddps:
                d.train()
        return {"eval_loss": sum(losses) / len(losses), **self.chunks[0].eval_record(metrics[0])}

    # ---- checkpoints -------------------------------------------------------------------------
    def _shape_files(self) -> Dict:
        """A converted model's shape file and Hugging Face assets travel into every saved checkpoint."""
        ck = self.config.checkpoint
        if ck.model_shape is None:
            return {}
        from megatron_csbp.checkpoint.files import ASSETS_DIR
        have = [d for d in (ck.load, ck.pretrained_checkpoint) if d and os.path.isdir(os.path.join(d, ASSETS_DIR))]
        return {"shape": ck.model_shape, "assets_from": os.path.join(have[0], ASSETS_DIR) if have else None}

    def save(self, iteration: int, consumed: int) -> None:
        """Atomic: a crash mid-save leaves the previous checkpoint and tracker intact."""
        from megatron_csbp.checkpoint import files, state

        ck = self.config.checkpoint
        previous = files.read_tracker(ck.save) if ck.save_retain_interval and os.path.isdir(ck.save) else None
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)

        # the error lines megatron-core's checkpoint writer logs, kept (the one line of a failed save restates
        # their cause) instead of printed
        writer_log, writer_errors = logging.getLogger(filesystem_async.__name__), []

        def keep_errors(record) -> bool:
            if record.levelno >= logging.ERROR:
                writer_errors.append(record.getMessage())
            return record.levelno < logging.ERROR

        writer_log.addFilter(keep_errors)
        if self.config.parallel.overlap_param_gather:  # Megatron-LM's `force_param_sync` before a save: the
            self.ddp.start_param_sync(force_sync=True)  # distributed optimizer's gather of the updated weights
        try:
            state.save_checkpoint(ck.save, iteration, self.model, self.optimizer, self.scheduler, consumed,
                                  extra={"model_args": dict(ck.model_meta)}, **self._shape_files(), **self._lora_save())
        except (Exception, CheckpointException) as exc:  # a full disk, a read-only or vanished folder, ... (any rank's)
            if isinstance(exc, files.CheckpointError):
                raise
            last = f"iteration {self.last_saved}" if self.last_saved is not None else "none"
            raise files.CheckpointError(f"cannot save the checkpoint of iteration {iteration} to --save {ck.save}: "
                                        f"{state.failed_save(ck.save, iteration, exc, writer_errors)}; the latest "
                                        f"checkpoint there stays {last}") from exc
        finally:
            writer_log.removeFilter(keep_errors)
        self.last_saved = iteration
        _log0(f" saved checkpoint at iteration {iteration} to {ck.save}")
        if ck.save_retain_interval and dist.get_rank() == 0:
            dropped = state.drop_unretained(ck.save, previous, iteration, ck.save_retain_interval)
            if dropped:
                _log0(f" deleted checkpoint {dropped} (--save-retain-interval {ck.save_retain_interval})")

    def _lora_save(self) -> Dict:
        """A LoRA run saves its adapters (their optimizer state with them) and its LoRA record."""
        if self.lora is None:
            return {}
        from megatron_csbp.checkpoint.files import LORA_FILE
        from megatron_csbp.lora.checkpoint import record_json

        return {"keep": is_adapter, "files": {LORA_FILE: record_json(self.lora, self.base)}}

    def load(self) -> Tuple[int, int]:
        """Resume from `--load` (a training checkpoint: iteration and consumed samples; a converted
        release: weights only, from iteration 0). Returns (iteration, consumed samples)."""
        from megatron_csbp.checkpoint import files, state
        from megatron_csbp.lora.checkpoint import base_record, check_resume

        ck = self.config.checkpoint
        iteration, consumed = 0, 0
        step = files.checkpoint_to_load(ck.load, ck.ckpt_step)
        if ck.pretrained_checkpoint and self.lora is not None:
            self.base = base_record(ck.pretrained_checkpoint)
        if step is not None:
            check_resume(ck.load, step, self.lora, self.base)  # before a base is read
        if ck.pretrained_checkpoint and (self.lora is not None or step is None):
            # Megatron-LM's: the pretrained weights when --load holds no checkpoint; a LoRA run's frozen base
            base = state.load_checkpoint(ck.pretrained_checkpoint, self.model, None, None,
                                         keep=lambda k: not is_adapter(k))
            self.optimizer.reload_model_params()  # main (fp32) params from the loaded weights
            _log0(f" loaded the weights of --pretrained-checkpoint {base['path']} (weights only"
                  f"{': the frozen base of the adapters' if self.lora is not None else ', iteration 0, fresh optimizer'})")
        if ck.load:
            # --finetune / --no-load-optim: the weights only (Megatron's: no optimizer or scheduler state)
            weights_only = ck.finetune or ck.no_load_optim
            info = state.load_checkpoint(ck.load, self.model, None if weights_only else self.optimizer,
                                         None if weights_only else self.scheduler, step,
                                         keep=is_adapter if self.lora is not None else None)
            if weights_only and info is not None:
                self.optimizer.reload_model_params()  # main (fp32) params from the loaded weights
            if ck.finetune and info is not None and not info.get("release"):
                _log0(f" --finetune: loaded the weights of {info['path']}; iteration and consumed samples start at 0")
                info = dict(info, iteration=0, consumed_samples=0)
            if info is None and ck.model_shape is not None and not ck.pretrained_checkpoint:
                raise files.CheckpointError(f"--load {ck.load} has a model shape file but no checkpoint to load")
            if info is not None and info.get("release"):
                _log0(f" loaded converted model {info['path']} (release: weights only, iteration 0, fresh optimizer)")
            elif info is not None:
                iteration, consumed = info["iteration"], info["consumed_samples"]
                self.last_saved = iteration
                _log0(f" loaded checkpoint {info['path']} (iteration {iteration}, consumed samples {consumed})")
            else:
                _log0(f" no checkpoint in --load {ck.load}: starting from scratch")
        self.iteration, self.consumed = iteration, consumed
        return iteration, consumed

    # ---- the loop ----------------------------------------------------------------------------
    def train(self, exit_signal=None) -> Dict:
        """load -> [train_step, log, evaluate, save]* -> final save. Returns the logged history.
        Megatron-LM's exit conditions (--exit-signal-handler: --exit-signal, SIGINT; --exit-duration-in-mins;
        --exit-interval) end the loop after an iteration, with a save (training/signals.py).
        `exit_signal`: an active `ExitSignal` installed earlier (the CLI installs it before the build,
        as Megatron-LM does at initialization); with --exit-signal-handler and none, one is
        installed here."""
        if exit_signal is not None or not self.config.batch.exit_signal_handler:
            return self._train(exit_signal)
        with ExitSignal(exit_signals(self.config.batch.exit_signal)) as exit_signal:
            return self._train(exit_signal)

    def _train(self, exit_signal) -> Dict:
        from megatron_csbp.attention.accounting import traffic_counter

        c = self.config
        bc, ck = c.batch, c.checkpoint
        iteration, consumed = self.load()
        if c.data.num_workers and not bc.skip_train:
            sampler = MicroBatchSampler(consumed, bc.train_iters * bc.global_batch_size, bc.num_microbatches,
                                        bc.micro_batch_size, self.dp_rank, self.dp_size)
            self._batches, self._batches_at = train_batches(self.train_ds, sampler, c.data.num_workers), consumed
        logger = Logger(c.log, bc, iteration)
        history = []
        world = dist.get_world_size()
        tokens_per_iter = bc.global_batch_size * bc.seq_length
        try:
            if bc.skip_train:
                rec = {"iteration": iteration, **self.evaluation()}
                logger.write(rec)
                history.append(rec)
                return {"history": history, "iteration": iteration}
            if ck.save and ck.save_initial and iteration == 0:
                self.save(0, 0)
            acc_time, acc_iters = 0.0, 0
            stop_at = bc.train_iters
            exits = ExitConditions(exit_signal, bc.exit_duration_in_mins, bc.exit_interval)
            start_iteration, wall_start = iteration, time.perf_counter()
            train_losses = []  # (iteration, loss) of every step, for plots
            why = None  # the exit condition that ends the run early (training/signals.py)
            while iteration < stop_at and why is None:
                traffic_counter().reset()
                t0 = time.perf_counter()
                step = self.train_step(consumed)
                dt = time.perf_counter() - t0
                iteration += 1
                consumed += bc.global_batch_size
                self.iteration, self.consumed = iteration, consumed
                train_losses.append((iteration, step.loss))
                acc_time += dt
                acc_iters += 1
                logger.step()
                do_log = iteration % c.log.log_interval == 0 or iteration == stop_at or iteration == 1
                do_eval = bool(c.eval.eval_interval and c.eval.eval_iters and iteration % c.eval.eval_interval == 0)
                if do_log or do_eval:
                    comm, mem, ms = allreduce([float(traffic_counter().total), float(peak_memory_bytes()), acc_time],
                                              op=dist.ReduceOp.MAX)
                    per_iter = ms / max(acc_iters, 1)
                    rec = {"iteration": iteration, "consumed_samples": consumed, "loss": step.loss,
                           "grad_norm": step.grad_norm, "lr": self.optimizer.param_groups[0]["lr"],
                           "ms_per_iteration": 1000.0 * per_iter, "tokens_per_second": tokens_per_iter / per_iter,
                           "tflops_per_gpu": self.flops_per_sample * bc.global_batch_size / per_iter / world / 1e12,
                           "attn_comm_bytes": int(comm), "peak_memory_bytes": int(mem), "skipped": not step.ok}
                    if do_eval:
                        rec.update(self.evaluation())
                    # Remaining time at the mean pace so far (training, evaluation and checkpoints included).
                    pace = (time.perf_counter() - wall_start) / (iteration - start_iteration)
                    rec["eta_seconds"] = pace * (stop_at - iteration)
                    logger.write(rec)
                    history.append(rec)
                    acc_time, acc_iters = 0.0, 0
                if ck.save and ck.save_interval and iteration % ck.save_interval == 0:
                    self.save(iteration, consumed)
                why = exits.check(iteration)
            # the end, or an exit condition (Megatron-LM: save unless this iteration was just saved, exit 0)
            if ck.save and self.last_saved != iteration and iteration > 0:
                self.save(iteration, consumed)
            if why is not None:
                _log0(f" {why}" + (f"; resume with --load {ck.save}" if ck.save else " (no --save: nothing saved)"))
        finally:
            logger.close()
            self._batches = None  # ends the DataLoader's workers
        out = {"history": history, "iteration": iteration, "consumed_samples": consumed, "train_losses": train_losses}
        if why is not None:
            out["exit"] = why
            if exit_signal is not None and why.startswith("received"):
                out["exit_signal"] = exit_signal.name
        return out

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        destroy_process_groups()

    def __enter__(self) -> "Trainer":
        try:
            return self.build()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

