"""Enumerate the layouts a cluster admits and rank them by predicted throughput."""
from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Dict, Iterable, List, Optional, Sequence

from megatron_csbp.planner.cost import Estimate, Layout, Workload, estimate
from megatron_csbp.planner.hardware import HardwareProfile
from megatron_csbp.planner.lora import adapter_count
from megatron_csbp.planner.model_config import ModelConfig


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_flags(lay: Layout, wl: Workload, model_layers: Optional[int] = None) -> List[str]:
    """Megatron(-LM) flags plus the plugin's, as `python -m megatron_csbp.train` takes them, each
    written as its declaration says (`config.options.flag_text`; `model_layers`: the model's layers,
    needed when the layout interleaves, `lay.vp` > 1)."""
    from megatron_csbp.config.options import flag_text

    if lay.vp > 1 and not model_layers:
        raise ValueError("an interleaved layout's flags need the model's layer count")
    full, dflash = lay.recompute == "full", wl.objective == "dflash"
    v = dict(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,  # VP: layers per model chunk
             num_layers_per_virtual_pipeline_stage=lay.vp > 1 and model_layers // (lay.pp * lay.vp),
             context_parallel_size=lay.cp, block_parallel_size=lay.bp, expert_model_parallel_size=lay.ep > 1
             and lay.ep, sequence_parallel=lay.tp > 1, attention_transport=lay.cp > 1 and lay.transport,
             block_ownership=lay.bp > 1 and lay.schedule, recompute_granularity=full and "full",
             recompute_method=full and "uniform", recompute_num_layers=full and 1,
             use_distributed_optimizer=lay.distributed_optimizer, objective=dflash and "dflash",
             dflash_max_anchors=dflash and wl.anchors, seq_length=wl.seq_length, block_size=wl.block_size,
             micro_batch_size=1, global_batch_size=wl.global_batch_size or lay.dp, bf16=True,
             grad_reduce_in_bf16=wl.grad_bytes == 2,
             # Megatron's packed-document flags (attention and positions stay inside documents)
             reset_attention_mask=wl.packed, reset_position_ids=wl.packed)
    flags = [flag_text(k, x) for k, x in v.items() if x is not False]  # False: not printed
    if wl.lora is not None:  # the trainer's LoRA flags (its --lora-alpha and --lora-init: their defaults)
        flags += [flag_text("lora_rank", wl.lora.rank), "--lora-target-modules " + " ".join(wl.lora.target_modules)]
        flags += [flag_text("lora_dropout", wl.lora.dropout)] if wl.lora.dropout else []
    return flags


def candidate_layouts(model: ModelConfig, wl: Workload, gpus: int, gpus_per_node: int,
                      transports: Iterable[str] = ("allgather", "ring"),
                      schedules: Iterable[str] = ("mirrored",),
                      recompute: Iterable[str] = ("none", "full"),
                      distributed_optimizer: bool = True,
                      pipelines: Iterable[int] = (1, 2, 4, 8),
                      virtual_stages: Iterable[int] = (1, 2, 4)) -> List[Layout]:
    """Every layout of `gpus`: TP x PP (x VP) x (CP, BP) x DP (x EP), with the recompute, transport
    and ownership options. PP sizes from `pipelines` that divide the layers (the drafter: PP 1);
    with PP > 1, interleaved 1F1B with V from `virtual_stages` where the trainer admits it: V
    divides the layers of a stage and the micro-batches per replica are a multiple of PP."""
    if wl.seq_length % wl.block_size:
        raise ValueError(f"--seq-length {wl.seq_length} is not a multiple of --block-size {wl.block_size}")
    heads = [h for l in model.layers for h in ((l.gdn_key_heads, l.gdn_value_heads) if l.is_gdn else (l.num_heads,))]
    dflash = wl.objective == "dflash"
    experts = max(l.num_experts for l in model.layers)
    out = []
    for tp, pp in product(divisors(gpus), pipelines):
        # (the drafter runs at TP = 1, model/dflash.py: fc over the context is not split, and PP = 1)
        if (tp > gpus_per_node or any(h % tp for h in heads) or (gpus // tp) % pp or model.num_layers % pp
                or (dflash and (tp > 1 or pp > 1))):
            continue
        rest = gpus // (tp * pp)  # the ranks of one stage: (CP, BP) x DP (x EP)
        for S in divisors(rest):
            dp = rest // S
            if (wl.global_batch_size and wl.global_batch_size % dp) or wl.seq_length % (2 * S):
                continue
            micro = wl.samples_per_replica(dp)
            vps = [1] + [v for v in virtual_stages
                         if pp > 1 and v > 1 and (model.num_layers // pp) % v == 0 and micro % pp == 0]
            eps = ([e for e in divisors(dp * S) if experts % e == 0 and tp * e <= max(gpus_per_node, tp)]
                   if experts else [1])
            for cp, bp in [(1, 1)] if S == 1 else [(S, 1), (1, S)] + [(c, S) for c in divisors(S) if c > 1]:
                if bp > 1 and (wl.anchors if dflash else wl.seq_length // wl.block_size) < bp:
                    continue
                out += [Layout(tp, cp, bp, ep, dp, rc, tr, sc, distributed_optimizer, pp, vp)
                        for ep, rc, tr, sc, vp in product(eps, recompute, transports if cp > 1 else ("allgather",),
                                                          schedules if bp > 1 else ("mirrored",), vps)]
    return out


def plan(model: ModelConfig, wl: Workload, gpus: int, gpus_per_node: int, hw: HardwareProfile,
         baseline: str = "ours", only: Sequence[str] = (), **options) -> Dict:
    """Every candidate layout, fastest first. `baseline`: how CP layouts are charged ('ours', or the
    paper's 'reference' CP path, `planner/reference.py`); `only`: the layout labels to keep (as
    printed, without the options in parentheses). With `wl.lora`, each layout also carries its full
    fine-tuning estimate (`full_fine_tuning`)."""
    from megatron_csbp.planner.reference import baseline_for

    bm = baseline_for(baseline, model.name)
    if gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"--gpus ({gpus}) and --gpus-per-node ({gpus_per_node}) must be >= 1")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"--gpus {gpus} is not a multiple of --gpus-per-node {gpus_per_node}")
    candidates = candidate_layouts(model, wl, gpus, gpus_per_node, **options)
    if only:
        names = {lay.label().split(" (")[0] for lay in candidates}
        if set(only) - names:
            raise ValueError(f"--layouts {' '.join(sorted(set(only) - names))}: not a layout of {gpus} GPUs "
                             f"(e.g. {', '.join(sorted(names)[:4])})")
        candidates = [lay for lay in candidates if lay.label().split(" (")[0] in only]
    estimates: List[Estimate] = [estimate(model, lay, wl, hw, gpus_per_node, bm) for lay in candidates]
    # fastest first; on equal throughput, less memory, then less traffic (CSBP over CP when the
    # ring transport hides CP's traffic completely)
    feasible = sorted((e for e in estimates if e.feasible),
                      key=lambda e: (-round(e.tokens_per_s, 3), round(e.peak_memory_gib, 3), e.attn_bytes_per_gpu))
    # the layouts asked for by name that do not fit are shown too (`layouts_not_fitting`)
    unfit = [e for e in estimates if not e.feasible] if only else []
    layouts, not_fitting = ([e.to_dict(layout_flags(e.layout, wl, model.num_layers)) for e in group]
                            for group in (feasible, unfit))
    if wl.lora is not None:  # the same layout trained fully: step, peak and whether it fits
        full = replace(wl, lora=None)
        for e, d in zip(feasible + unfit, layouts + not_fitting):
            f = estimate(model, e.layout, full, hw, gpus_per_node, bm).to_dict([])
            d["full_fine_tuning"] = {k: f[k] for k in ("step_time_s", "tokens_per_s", "peak_memory_gib", "feasible",
                                                        "memory_breakdown_gib")}
    best = layouts[0] if layouts else None
    baselines = [l for l in layouts if l["bp"] == 1]
    return {
        "model": model.summary(), "objective": wl.objective, "hardware": hw.name, "seq_length": wl.seq_length,
        "block_size": wl.block_size, "gpus": gpus, "gpus_per_node": gpus_per_node,
        "global_batch_size": wl.global_batch_size or "one sample per data-parallel replica",
        "evaluated": len(estimates), "infeasible": len(estimates) - len(feasible),
        "layouts": layouts, "best": best, "best_baseline": baselines[0] if baselines else None,
        "speedup_best_vs_baseline": (best["tokens_per_s"] / baselines[0]["tokens_per_s"]
                                     if best and baselines else None),
        **({"layouts_not_fitting": not_fitting} if only else {}),
        # the LoRA the plan assumes: rank, targets, dropout, trained (adapter) and frozen parameters
        **({"lora": {"rank": wl.lora.rank, "target_modules": list(wl.lora.target_modules), "dropout": wl.lora.dropout,
                     "adapter_params": adapter_count(model, wl.lora), "base_params": model.total_params}}
           if wl.lora is not None else {}),
    }


def find(result: Dict, **match) -> Optional[Dict]:
    """The best feasible layout in a plan result whose fields equal `match`."""
    return next((l for l in result["layouts"] if all(l.get(k) == v for k, v in match.items())), None)
