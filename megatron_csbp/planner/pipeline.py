"""Pipeline parallelism in the cost model: P stages of a layout, each costed by `cost.estimate`.

A layout with `pp` > 1 splits the model's layers evenly into `pp` stages (`--pipeline-model-
parallel-size`, Megatron's even split); every stage runs the same TP x CP/BP layout on its layers.
Per micro-batch (one sample) each stage's time is `cost.estimate` of a model holding only its
layers (the output layer and logits only on the last stage, the embedding only on the first), plus
its P2P: this rank's rows' hidden states, rows x hidden x bytes (/ TP under sequence parallelism),
sent forward and their gradient received backward, exposed (Megatron's 1F1B waits on each).

Schedule: non-interleaved 1F1B, m = global batch / DP micro-batches per step:

    step = (m + pp - 1) x max over stages (stage time per micro-batch) + gradient reduction + optimizer
    bubble = (pp - 1) / (m + pp - 1)

Memory of stage s (0-based): its weights, gradients and optimizer state; the activations of
min(pp - s, m) in-flight micro-batches (1F1B: the first stage holds pp of them); logits on the
last stage only (one micro-batch at a time). The largest stage sets the layout's peak.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List

from megatron_csbp.planner.hardware import GiB, HardwareProfile
from megatron_csbp.planner.model_config import ModelConfig


def stage_layers(model: ModelConfig, pp: int) -> List[tuple]:
    n = model.num_layers
    if n % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} must divide the model's {n} layers")
    k = n // pp
    return [tuple(model.layers[i * k:(i + 1) * k]) for i in range(pp)]


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

    pp = lay.pp
    flat = replace(lay, pp=1)
    micro = wl.samples_per_replica(lay.dp)
    one = Workload(**{**wl.__dict__, "global_batch_size": lay.dp})  # one micro-batch per replica
    p2p = boundary_bytes(model, lay, wl, hw)
    # Megatron orders ranks tp-cp-ep-dp-pp: stages are gpus / pp ranks apart
    link = hw.link_gbps(_spans_nodes(lay.gpus // pp + 1, gpus_per_node)) * 1e9
    lat = hw.collective_latency_us * 1e-6
    stages = []
    for s, layers in enumerate(stage_layers(model, pp)):
        first, last = s == 0, s == pp - 1
        stage_model = replace(model, layers=layers)
        e = estimate(stage_model, flat, one, hw, gpus_per_node, *([baseline] if baseline is not None else []))
        t = {k: v for k, v in e.time.items() if k not in ("grad_reduce_exposed", "optimizer")}
        if not last:
            t["output_layer"] = 0.0
        # per micro-batch: the activation forward and its gradient backward over each boundary
        # (a middle stage's sends to the next and receives from the previous run together)
        sends = (0 if last else 1) + (0 if first else 1)  # boundary tensors this stage sends
        t["p2p_exposed"] = 2 * (p2p / link + lat)
        # weights of the stage: its layers, the embedding (first) and the output layer (last)
        emb = model.vocab_size * model.hidden_size
        dense = sum(model.layer_dense_params(l) for l in layers) + (emb if first else 0) + (emb if last else 0)
        t_grad, t_opt, static = _step_terms(stage_model, flat, wl, hw, gpus_per_node, dense)
        acts = e.memory_gib["activations"] * GiB
        logits = e.memory_gib["logits"] * GiB if last else 0.0
        in_flight = min(pp - s, micro)
        peak = static + in_flight * acts + logits + hw.reserved_gib * GiB
        stages.append(dict(time=t, t_micro=sum(t.values()), t_grad=t_grad, t_opt=t_opt, static=static, acts=acts,
                           in_flight=in_flight, logits=logits, peak=peak, sent=e.attn_bytes_per_gpu,
                           p2p_bytes=sends * p2p))
    slow = max(stages, key=lambda x: x["t_micro"])
    t_grad = max(x["t_grad"] for x in stages)
    t_opt = max(x["t_opt"] for x in stages)
    slots = micro + pp - 1
    step = slots * slow["t_micro"] + t_grad + t_opt
    time = {k: slots * v for k, v in slow["time"].items()}
    time.update(grad_reduce_exposed=t_grad, optimizer=t_opt, pipeline_bubble=(pp - 1) * slow["t_micro"])
    worst = max(stages, key=lambda x: x["peak"])
    mem = {"weights_grads_optimizer": worst["static"] / GiB, "activations": worst["in_flight"] * worst["acts"] / GiB,
           "logits": worst["logits"] / GiB, "reserved": hw.reserved_gib}
    info = {"schedule": "1F1B", "micro_batches": micro, "bubble_fraction": (pp - 1) / slots,
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
