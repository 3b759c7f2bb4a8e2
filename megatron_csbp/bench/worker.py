"""One rank of a benchmark world: every (sequence length, layout) case, one after the other.

A timed step is the trainer's (`Trainer.train_step` on one micro-batch of mock tokens: forward,
backward, Megatron DDP's gradient sum over the shard group, Adam). Every case starts from the same
weights (same seed) and sees the same tokens and noise, so the step-0 loss is the same under every
layout: a cheap check that each layout computes the same thing.
"""
from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from functools import partial
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_csbp.bench.cases import AnyModel, BenchConfig, Case, DiffusionGemmaBenchModel, trainer_argv
from megatron_csbp.bench.memory import step_memory


def trainer_of(argv: List[str], **kw):
    """The `Trainer` (not built yet) of the trainer's command line `argv`; `kw` to its constructor."""
    from megatron_csbp.training.arguments import parse_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer

    return Trainer(TrainerConfig.from_args(parse_args(argv)), **kw)


def bench_trainer(model: AnyModel, case: Case, seq_length: int, seed: int):
    """A built `Trainer` of the benchmark's model on this layout: mock tokens (`trainer_argv`), one
    micro-batch of `micro_batch_size` samples per step, Adam at a constant lr of 1e-4, the layout's
    process groups (already initialised: `process_groups`)."""
    argv = trainer_argv(dict(
        model.flags(), seq_length=seq_length, global_batch_size=model.micro_batch_size, train_iters=10 ** 6, lr=1e-4,
        lr_decay_style="constant", seed=seed, context_parallel_size=case.cp, block_parallel_size=case.bp,
        attention_transport=case.transport, block_ownership=case.schedule))
    provider = None
    if isinstance(model, DiffusionGemmaBenchModel):
        # DiffusionGemma's clean stream is token-causal; the model comes from `provider`
        argv += ["--clean-attention=token_causal"]
        provider = partial(diffusion_gemma, model, seed, case.attention == "full")
    return trainer_of(argv, gpt_provider=provider).build()


def diffusion_gemma(model: DiffusionGemmaBenchModel, seed: int, full_attention: bool, args):
    """(config, model) of the tiny DiffusionGemma in megatron-core, weights redrawn from `seed` (the
    same on every layout); `full_attention` turns every layer to full attention (same weights and
    head shapes)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.attention.core_attention import BlockDiffusionAttention
    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model
    from megatron_csbp.model.diffusiongemma.tiny import redraw_weights, tiny_megatron_config

    model_parallel_cuda_manual_seed(seed)
    shape = ("sliding_window", "layer_types", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "full_num_query_groups", "full_kv_channels", "ffn_hidden_size", "num_moe_experts", "moe_router_topk",
             "moe_ffn_hidden_size")
    config = tiny_megatron_config(**{k: getattr(model, k) for k in shape}, calculate_per_token_loss=True)
    gpt = diffusion_gemma_model(config, model.vocab_size, args.seq_length).train()
    redraw_weights(gpt, seed)
    for m in gpt.modules():
        if full_attention and isinstance(m, BlockDiffusionAttention):
            m.window = None
    return config, gpt


@contextmanager
def process_groups(case: Case):
    """The layout's process groups, initialised for the `with` block."""
    from megatron_csbp.parallel import state as bps

    bps.initialize_block_parallel(1, 1, case.cp, case.bp, 1)
    try:
        yield
    finally:
        bps.destroy_block_parallel()


def _measure(case: Case, seq_length: int, cfg: BenchConfig) -> Dict:
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.attention.accounting import traffic_counter

    m = cfg.model
    shard_rank, shard_group = bps.get_shard_rank(), bps.get_shard_group()
    trainer = bench_trainer(m, case, seq_length, cfg.seed)

    def step(i: int) -> float:  # the trainer's step on samples i * micro_batch_size, ...
        return trainer.train_step(i * m.micro_batch_size).loss  # (the global loss: summed over ranks)

    counter = traffic_counter()
    times: List[float] = []
    # per timed step (the record holds each one's median): seconds this rank waited on attention
    # collectives, and they were in flight (posted to waited for); the same for the forward
    # collectives alone (the ones that can overlap); CPU seconds of this rank's main thread and of
    # the whole rank process (gloo's threads included)
    per_step: Dict[str, List[float]] = {k: [] for k in (
        "exposed_comm_s", "in_flight_comm_s", "forward_exposed_comm_s", "forward_in_flight_comm_s", "thread_cpu_s",
        "process_cpu_s")}
    transfers = 0
    losses = []
    for i in range(cfg.warmup + cfg.steps):
        dist.barrier(group=shard_group)
        counter.reset()
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        losses.append(step(i))
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dc, dp = time.thread_time() - c0, time.process_time() - p0
        # a step lasts as long as its slowest rank
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=shard_group)
        if i >= cfg.warmup:
            times.append(float(dt))
            forward = [sum(v for (_, phase), v in by_phase.items() if phase == "forward")
                       for by_phase in (counter.waited_s, counter.in_flight_s)]
            for key, value in zip(per_step, [counter.total_waited_s, counter.total_in_flight_s, *forward, dc, dp]):
                per_step[key].append(value)
            transfers += counter.transfers
    # before the untimed steps below add to the counter
    sent, received, per_layer = counter.total_sent, counter.total_received, counter.per_layer()

    peak_tensor = static = rss_peak = None
    if cfg.measure_memory:
        peak_tensor, static, rss_peak = step_memory(lambda: step(cfg.warmup + cfg.steps), shard_group)
    record = {
        "case": case.name, "kind": case.kind, "cp": case.cp, "bp": case.bp, "size": case.shard_group_size,
        "transport": case.transport, "schedule": case.schedule, "seq_length": seq_length, "shard_rank": shard_rank,
        "rows": len(trainer.model.bdlm.plan.local), "step_times_s": times, "median_step_s": statistics.median(times),
        "loss_step0": losses[0], "attn_bytes_sent": sent, "attn_bytes_received": received,
        "attn_bytes_per_layer": per_layer, "peak_tensor_bytes": peak_tensor, "static_tensor_bytes": static,
        "rss_high_water_bytes": rss_peak, "thread_cpu_steps_s": per_step["thread_cpu_s"], "transfers": transfers,
        **{key: statistics.median(values) for key, values in per_step.items()}}
    if cfg.count_ops:
        record["op_counts"] = count_ops(lambda: step(cfg.warmup + cfg.steps + 1))
    if case.attention is not None:
        record["attention"] = case.attention
    del trainer
    return record


def slowest_rank_s(fn, group=None):
    """`fn()` between a barrier of `group` and a MAX all-reduce of its wall time and main-thread CPU
    time: (the slowest rank's seconds, the largest CPU seconds, what `fn` returned)."""
    dist.barrier(group=group)
    t0, c0 = time.perf_counter(), time.thread_time()
    out = fn()
    dt = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return float(dt[0]), float(dt[1]), out


def count_ops(run) -> Dict[str, int]:
    """Calls of each aten op (and autograd function) in `run()`, by torch.profiler: a count that
    other jobs on the machine cannot change, unlike its time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return {e.key: e.count for e in prof.key_averages()}


def world_main(rank: int, world_size: int, cfg: BenchConfig, cases: List[Case]) -> List[Dict]:
    """Entry point of one spawned rank: all cases of this world size, every sequence length."""
    import warnings

    warnings.filterwarnings("ignore")  # Megatron's CPU/apex notices, once per case otherwise
    results = []
    for case in cases:
        with process_groups(case):  # once per case, then every sequence length
            records = [_measure(case, L, cfg) for L in cfg.seq_lengths]
        results += records
        for r in records:
            if rank == 0 and os.environ.get("CSBP_BENCH_VERBOSE"):
                print(f"[bench] P={world_size} L={r['seq_length']} {case.name}: {r['median_step_s'] * 1e3:.1f} ms, "
                      f"{r['attn_bytes_sent'] / 2**20:.2f} MiB sent", flush=True)
    return results
