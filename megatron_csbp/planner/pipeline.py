"""Pipeline parallelism in the cost model: P stages of a layout, each costed by `cost.estimate`.

A layout with `pp` > 1 splits the model's layers evenly into `pp` stages (`--pipeline-model-
parallel-size`, Megatron's even split); every stage runs the same TP x CP/BP layout on its layers.
Per micro-batch (one sample) each stage's time is `cost.estimate` of a model holding only its
layers (the output layer and logits only on the last stage, the embedding only on the first), plus
its P2P: this rank's rows' hidden states, rows x hidden x bytes (/ TP under sequence parallelism),
sent forward and their gradient received backward, exposed (Megatron's 1F1B waits on each).

Schedules, m = global batch / DP micro-batches per step, t = the slowest rank's time for one
micro-batch through all its layers:

- 1F1B (`vp` = 1): step = (m + pp - 1) t + gradient reduction + optimizer; bubble (pp - 1) t,
  i.e. (pp - 1) / m of the ideal m t (Narayanan et al. 2021, eq. 1).
- interleaved 1F1B (`vp` = V > 1, `--num-layers-per-virtual-pipeline-stage`): each rank holds V
  model chunks of layers / (pp V) layers, rank r chunks r, r + pp, ... (megatron-core's layout);
  a chunk's pass takes t / V, so the bubble shrinks to (pp - 1) t / V, (pp - 1) / (V m) of the
  ideal time (Megatron's interleaved schedule): step = (m + (pp - 1) / V) t + ... Every chunk
  boundary is a P2P hop: V x the messages (and exposed seconds) of 1F1B per micro-batch. The
  trainer's rules (`megatron_csbp/pipeline.py::check_pipeline_args`): m a multiple of pp, the
  layers of a stage divisible by V.

Memory of rank s (0-based): its weights, gradients and optimizer state; the activations in flight,
in model chunks, as megatron-core's schedule warms up (`get_pp_rank_microbatches`): 1F1B
min(pp - s, m) micro-batches; interleaved min(2 (pp - s - 1) + (V - 1) pp + 1, m V) chunks of 1/V
of the rank's activations each, so the first rank holds pp + (pp - 1) / V micro-batches' worth,
Megatron's `1 + (pp - 1) / (pp V)` interleaving penalty (`theoretical_memory_usage.py`); logits on
the last rank only (one micro-batch at a time). The largest rank sets the layout's peak.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List

from megatron_csbp.planner.hardware import GiB, HardwareProfile
from megatron_csbp.planner.model_config import ModelConfig


def stage_layers(model: ModelConfig, pp: int, vp: int = 1) -> List[tuple]:
    """The layers each pipeline rank holds: with `vp` virtual stages, rank r holds chunks r, r + pp,
    ..., r + (vp - 1) pp of layers / (pp vp) consecutive layers each (megatron-core's interleaved
    layout); `vp` = 1: one contiguous stage."""
    n = model.num_layers
    if n % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} must divide the model's {n} layers")
    if vp < 1 or (n // pp) % vp:
        raise ValueError(f"--num-virtual-stages-per-pipeline-rank {vp} must divide the {n // pp} layers of a "
                         f"pipeline stage ({n} layers / --pipeline-model-parallel-size {pp})")
    k = n // (pp * vp)
    return [tuple(l for v in range(vp) for l in model.layers[(v * pp + r) * k:(v * pp + r + 1) * k])
            for r in range(pp)]


def bubble_slots(micro: int, pp: int, vp: int = 1) -> float:
    """Step length in units of one rank's micro-batch time t: the m micro-batches plus the bubble,
    (pp - 1) t for 1F1B, (pp - 1) t / vp for the interleaved schedule."""
    return micro + (pp - 1) / vp


def in_flight_chunks(rank: int, micro: int, pp: int, vp: int = 1) -> int:
    """Model chunks whose activations rank `rank` holds at its peak: megatron-core's warm-up
    forwards + 1 (`get_pp_rank_microbatches`, micro-batch groups of pp), at most every chunk of
    the step (m vp)."""
    warmup = pp - rank - 1 if vp == 1 else 2 * (pp - rank - 1) + (vp - 1) * pp
    return min(warmup + 1, micro * vp)


def check_interleaving(model: ModelConfig, pp: int, vp: int, micro: int) -> None:
    """The trainer's interleaving rules (`megatron_csbp/pipeline.py::check_pipeline_args`)."""
    if vp == 1:
        return
    if pp < 2:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 (got {pp})")
    stage_layers(model, pp, vp)
    if micro % pp:
        raise ValueError(f"interleaved pipelining needs the micro-batches per iteration ({micro}) to be a multiple of "
                         f"--pipeline-model-parallel-size {pp}")


def boundary_bytes(model: ModelConfig, lay, wl, hw: HardwareProfile) -> int:
    """Bytes of one stage boundary tensor per micro-batch (one direction): the largest rank's rows."""
    from megatron_csbp.planner.work import rank_work

    rows = max(w.rows for w in rank_work(wl.seq_length, wl.block_size, lay.cp, lay.bp, lay.schedule,
                                         model.clean_attention, None))
    return int(rows * model.hidden_size * hw.dtype_bytes / lay.tp)


def estimate_pipelined(model: ModelConfig, lay, wl, hw: HardwareProfile, gpus_per_node: int, baseline=None):
    """A PP layout's step: each stage's layers estimated as a PP-1 layout (charged by `baseline`,
    `cost.estimate`'s), plus the 1F1B bubble, in-flight activations and P2P."""
    from megatron_csbp.planner.cost import Estimate, Workload, _step_terms, _spans_nodes, estimate

    pp, vp = lay.pp, lay.vp
    flat = replace(lay, pp=1, vp=1)
    micro = wl.samples_per_replica(lay.dp)
    check_interleaving(model, pp, vp, micro)
    one = Workload(**{**wl.__dict__, "global_batch_size": lay.dp})  # one micro-batch per replica
    p2p = boundary_bytes(model, lay, wl, hw)
    # Megatron orders ranks tp-cp-ep-dp-pp: stages are gpus / pp ranks apart
    link = hw.link_gbps(_spans_nodes(lay.gpus // pp + 1, gpus_per_node)) * 1e9
    lat = hw.collective_latency_us * 1e-6
    stages = []
    for s, layers in enumerate(stage_layers(model, pp, vp)):
        first, last = s == 0, s == pp - 1
        stage_model = replace(model, layers=layers)
        e = estimate(stage_model, flat, one, hw, gpus_per_node, *([baseline] if baseline is not None else []))
        t = {k: v for k, v in e.time.items() if k not in ("grad_reduce_exposed", "optimizer")}
        if not last:
            t["output_layer"] = 0.0
        # per micro-batch: the activation forward and its gradient backward over each boundary
        # (a middle stage's sends to the next and receives from the previous run together); with
        # virtual stages every one of the rank's vp chunks does so
        sends = vp * 2 - (1 if last else 0) - (1 if first else 0)  # boundary tensors this rank sends
        t["p2p_exposed"] = vp * 2 * (p2p / link + lat)
        # weights of the stage: its layers, the embedding (first) and the output layer (last)
        emb = model.vocab_size * model.hidden_size
        dense = sum(model.layer_dense_params(l) for l in layers) + (emb if first else 0) + (emb if last else 0)
        t_grad, t_opt, static = _step_terms(stage_model, flat, wl, hw, gpus_per_node, dense)
        acts = e.memory_gib["activations"] * GiB
        logits = e.memory_gib["logits"] * GiB if last else 0.0
        chunks = in_flight_chunks(s, micro, pp, vp)
        in_flight = chunks if vp == 1 else chunks / vp  # in micro-batches' worth of the rank's layers
        peak = static + in_flight * acts + logits + hw.reserved_gib * GiB
        stages.append(dict(time=t, t_micro=sum(t.values()), t_grad=t_grad, t_opt=t_opt, static=static, acts=acts,
                           in_flight=in_flight, logits=logits, peak=peak, sent=e.attn_bytes_per_gpu,
                           p2p_bytes=sends * p2p))
    slow = max(stages, key=lambda x: x["t_micro"])
    t_grad = max(x["t_grad"] for x in stages)
    t_opt = max(x["t_opt"] for x in stages)
    slots = bubble_slots(micro, pp, vp)
    step = slots * slow["t_micro"] + t_grad + t_opt
    time = {k: slots * v for k, v in slow["time"].items()}
    time.update(grad_reduce_exposed=t_grad, optimizer=t_opt, pipeline_bubble=(slots - micro) * slow["t_micro"])
    worst = max(stages, key=lambda x: x["peak"])
    mem = {"weights_grads_optimizer": worst["static"] / GiB, "activations": worst["in_flight"] * worst["acts"] / GiB,
           "logits": worst["logits"] / GiB, "reserved": hw.reserved_gib}
    info = {"schedule": "1F1B" if vp == 1 else "interleaved 1F1B", "virtual_stages": vp, "micro_batches": micro,
            "bubble_fraction": (slots - micro) / slots,
            "stage_peak_gib": [x["peak"] / GiB for x in stages],
            "in_flight_micro_batches": [x["in_flight"] for x in stages],
            "p2p_bytes_per_micro_batch": p2p,
            "p2p_bytes_per_gpu": micro * max(x["p2p_bytes"] for x in stages) * 2}
    feasible = worst["peak"] <= hw.memory_gib * GiB
    return Estimate(
        layout=lay, step_time_s=step, tokens_per_s=micro * lay.dp * wl.seq_length / step,
        peak_memory_gib=worst["peak"] / GiB, attn_bytes_per_gpu=int(micro * max(x["sent"] for x in stages)),
        feasible=feasible, time=time, memory_gib=mem, pipeline=info,
        why_infeasible="" if feasible else f"needs {worst['peak'] / GiB:.1f} GiB > {hw.memory_gib:.1f} GiB",
    )
