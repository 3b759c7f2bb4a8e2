"""`python -m megatron_csbp.plan`: predict step time and memory of every layout and print the best.

Examples:
  python -m megatron_csbp.plan --model nemotron-diffusion-14b --seq-length 262144 --block-size 256 \\
      --gpus 16 --gpus-per-node 8 --hardware h200
  python -m megatron_csbp.plan --hf-config config.json --seq-length 131072 --block-size 64 --gpus 8 --json
  python -m megatron_csbp.plan --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
      --group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --swiglu --vocab-size 131072 \\
      --seq-length 65536 --block-size 32 --gpus 8 --hardware h100
  python -m megatron_csbp.plan --model dflash-drafter-muse-glimmer --objective dflash --dflash-max-anchors 512 \\
      --seq-length 524288 --block-size 16 --gpus 8 --hardware h100   # a DFlash drafter workload
  python -m megatron_csbp.plan --model qwen3-27b-like --seq-length 262144 --block-size 256 --gpus 16 \
      --doc-length-histogram docs/benchmarks/sft_doc_lengths.txt   # packed SFT (docs/planner.md)
  python -m megatron_csbp.plan --profile docs/benchmarks/cpu_profile.json   # measure this machine
"""
from __future__ import annotations

import argparse
import json

from megatron_csbp.layout.sizes import OWNERSHIP_SCHEDULES
from megatron_csbp.planner.cost import Workload
from megatron_csbp.planner.hardware import load_hardware, save_hardware
from megatron_csbp.planner.lora import TARGET_MODULES, LoRAPlan
from megatron_csbp.planner.model_config import (add_megatron_model_args, from_megatron_args, load_hf_config,
                                                load_preset, presets)
from megatron_csbp.planner.search import plan
from megatron_csbp.utils.cli import ArgumentParser, filter_warnings, report


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m megatron_csbp.plan", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model source (one of)")
    src.add_argument("--hf-config", metavar="FILE", help="a Hugging Face config.json (or the model folder holding it)")
    src.add_argument("--model", metavar="PRESET", help=f"a built-in config: {', '.join(presets())}")
    add_megatron_model_args(p)
    w = p.add_argument_group("workload and cluster")
    w.add_argument("--seq-length", type=int, help="clean tokens L per sample")
    w.add_argument("--block-size", type=int, help="block size B")
    w.add_argument("--global-batch-size", type=int, help="samples per step (default: one per data-parallel replica)")
    w.add_argument("--gpus", type=int, help="GPUs in the job")
    w.add_argument("--gpus-per-node", type=int, default=8)
    w.add_argument("--hardware", default="h200", help="h100, h200, measured, or a profile FILE")
    w.add_argument("--transports", nargs="+", default=["allgather", "ring"], choices=["allgather", "ring"])
    w.add_argument("--baseline", default="ours", choices=["ours", "reference"],
                   help="how CP layouts are charged: this project's CP (default) or the paper's reference CP path "
                        "(docs/planner.md, 'The paper explained')")
    w.add_argument("--block-ownership", nargs="+", default=["mirrored"], choices=OWNERSHIP_SCHEDULES)
    w.add_argument("--recompute", nargs="+", default=["none", "full"], choices=["none", "full"])
    w.add_argument("--no-distributed-optimizer", action="store_true")
    w.add_argument("--grad-reduce-in-bf16", action="store_true", help="bf16 main gradients (2 bytes, not 4)")
    w.add_argument("--logits-bytes", type=int, default=6,
                   help="bytes per logit element at the loss (6: bf16 logits + fp32 copy; 2: fused linear-CE)")
    w.add_argument("--loss-chunk-rows", type=int, default=0,
                   help="rows per chunk of a fused/chunked linear cross-entropy (0: all logits at once)")
    w.add_argument("--objective", choices=["bd3lm", "dflash"], default="bd3lm",
                   help="bd3lm: block diffusion training (every objective but the drafter); dflash: a DFlash "
                        "drafter on verifier features (needs a drafter model, e.g. --model dflash-drafter-muse-glimmer)")
    w.add_argument("--dflash-max-anchors", type=int, default=512, help="dflash: draft blocks (anchors) per sequence")
    w.add_argument("--dflash-doc-length", type=int,
                   help="dflash: document length the anchors' contexts stop at (default: one document per sequence)")
    w.add_argument("--dflash-vocab-chunk", type=int, default=8192,
                   help="dflash: vocabulary columns per chunk of the streamed loss")
    w.add_argument("--doc-length", type=int,
                   help="packed samples: documents of N tokens (the last one cut at --seq-length)")
    w.add_argument("--doc-length-histogram", metavar="FILE",
                   help="packed samples: document lengths drawn from FILE (JSON {length: count} or "
                        "'length count' lines) until --seq-length is full (docs/planner.md, 'Packed documents')")
    w.add_argument("--doc-length-seed", type=int, default=0, help="seed of the --doc-length-histogram draw")
    w.add_argument("--window-exchange", choices=["window", "all"], default="window",
                   help="CSBP sliding-window layers: exchange only the rows inside windows, or every clean row")
    lo = p.add_argument_group("LoRA (the trainer's flags; docs/lora.md, 'Memory, time and the planner')")
    lo.add_argument("--lora-rank", type=int, default=0,
                    help="plan LoRA fine-tuning of adapters of this rank on the frozen model (0: full fine-tuning); "
                         "each layout is shown next to full fine-tuning at the same layout")
    lo.add_argument("--lora-target-modules", nargs="+", default=list(TARGET_MODULES), metavar="MODULE",
                    help=f"linears given adapters, experts' included (default: {' '.join(TARGET_MODULES)})")
    lo.add_argument("--lora-dropout", type=float, default=0.0, help="adapter input dropout (keeps its mask)")
    o = p.add_argument_group("output")
    o.add_argument("--layouts", nargs="+", default=(), metavar="LABEL",
                   help="only these layouts, labelled as printed without the options, e.g. DP2/EP2/CP8/BP8")
    o.add_argument("--top", type=int, default=8, help="layouts to print")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    o.add_argument("--profile", metavar="FILE", help="measure this machine's hardware profile into FILE and exit")
    return p.parse_args(argv)


def model_from_args(args):
    given = [x for x in (args.hf_config, args.model) if x] + (["flags"] if args.num_layers else [])
    if len(given) > 1:
        raise ValueError("give exactly one of --hf-config, --model or the Megatron model flags")
    if args.hf_config:
        return load_hf_config(args.hf_config)
    if args.model:
        return load_preset(args.model)
    return from_megatron_args(args)


def _packing(args):
    """(document starts, summary) of the packed sample the planner counts; (None, None) unpacked."""
    from megatron_csbp.planner.packing import pack_starts, read_histogram

    if args.doc_length is None and args.doc_length_histogram is None:
        return None, None
    if args.doc_length is not None and args.doc_length_histogram is not None:
        raise ValueError("give one of --doc-length or --doc-length-histogram, not both")
    if args.objective == "dflash":
        raise ValueError("--objective dflash: give the drafter's documents with --dflash-doc-length, "
                         "not --doc-length / --doc-length-histogram")
    hist = read_histogram(args.doc_length_histogram) if args.doc_length_histogram else None
    starts = pack_starts(args.seq_length, args.doc_length, hist, args.doc_length_seed)
    lengths = [b - a for a, b in zip(starts, starts[1:] + (args.seq_length,))]
    source = (f"--doc-length {args.doc_length}" if hist is None else
              f"--doc-length-histogram {args.doc_length_histogram}, seed {args.doc_length_seed}")
    return starts, {"documents": len(starts), "source": source, "longest": max(lengths),
                    "mean_length": sum(lengths) / len(lengths)}


def format_table(result, top: int) -> str:
    packing, lora = result.get("packing"), result.get("lora")
    packed = (f"; packed: {packing['documents']} documents ({packing['source']}), "
              f"longest {packing['longest']}" if packing else "")
    lines = [f"model: {result['model']}",
             f"objective {result.get('objective', 'bd3lm')}, "
             f"L = {result['seq_length']}, B = {result['block_size']}, {result['gpus']} GPUs "
             f"({result['gpus_per_node']} per node), hardware {result['hardware']}; "
             f"{result['evaluated']} layouts evaluated, {result['infeasible']} do not fit in memory{packed}",
             # LoRA: what trains, against the frozen base
             *([f"LoRA rank {lora['rank']} on {' '.join(lora['target_modules'])}: {lora['adapter_params'] / 1e6:.1f}M "
                f"adapter parameters train ({100 * lora['adapter_params'] / lora['base_params']:.2f} % of the "
                f"{lora['base_params'] / 1e9:.2f}B frozen); 'full' columns: the same layout fully fine-tuned"]
               if lora else []),
             "",
             f"{'rank':>4}  {'layout':<44} {'step s':>9} {'tok/s':>9} {'peak GiB':>9} {'attn GiB/GPU':>12}"
             + ("   full: step s  peak GiB  fits" if lora else "")]
    for i, l in enumerate(result["layouts"][:top] + result.get("layouts_not_fitting", [])):
        full = l.get("full_fine_tuning")
        lines.append(f"{i + 1 if l['feasible'] else '-':>4}  {l['label']:<44} {l['step_time_s']:>9.2f} "
                     f"{l['tokens_per_s']:>9.0f} {l['peak_memory_gib']:>9.1f} {l['attn_bytes_per_gpu'] / 2**30:>12.2f}"
                     + (f"   {full['step_time_s']:>12.2f} {full['peak_memory_gib']:>9.1f}  "
                        f"{'yes' if full['feasible'] else 'no'}" if full else "")
                     + ("" if l["feasible"] else "   (does not fit)"))
    if not result["layouts"]:
        lines.append("  (no layout fits: more GPUs, recompute, or a shorter sequence)")
    for key, title in (("best", "best"), ("best_baseline", "best without block parallelism")):
        if result[key]:
            lines += ["", f"{title}: {result[key]['label']}", "  " + " ".join(result[key]["flags"])]
    if result.get("speedup_best_vs_baseline"):
        lines.append(f"\npredicted speedup of the best layout over the best baseline: "
                     f"{result['speedup_best_vs_baseline']:.3f}x")
        if why := why_no_speedup(result):
            lines.append(why)
    return "\n".join(lines)


def why_no_speedup(result) -> str:
    """One line saying why the predicted speedup prints as 1.000x ("" otherwise)."""
    best, base = result["best"], result["best_baseline"]
    if round(result["speedup_best_vs_baseline"], 3) != 1.0:
        return ""
    if best["bp"] == 1:
        return "why 1.000x: the best layout has no block parallelism (it is the best baseline)"
    exposed = [l["time_breakdown_s"].get("attn_comm_exposed", 0.0) for l in (base, best)]
    return (f"why 1.000x: the step times agree to 0.1 % (attention traffic not hidden behind compute: baseline "
            f"{exposed[0]:.2f} s, CSBP {exposed[1]:.2f} s of a {best['step_time_s']:.2f} s step), so CSBP gains "
            f"traffic ({best['attn_bytes_per_gpu'] / 2**30:.1f} vs {base['attn_bytes_per_gpu'] / 2**30:.1f} GiB/GPU) and peak "
            f"memory ({best['peak_memory_gib']:.1f} vs {base['peak_memory_gib']:.1f} GiB), not time; the paper's "
            f"1.2-1.6x is against its own CP baseline: --baseline reference")


def main(argv=None) -> int:
    filter_warnings()  # hide the library warnings a user cannot act on
    args = parse_args(argv)
    try:
        if args.profile:
            prof = load_hardware("measured")
            save_hardware(prof, args.profile)
            print(f"wrote {args.profile}: {prof.notes}")
            return 0
        missing = [f"--{name.replace('_', '-')}" for name in ("seq_length", "block_size", "gpus")
                   if getattr(args, name) is None]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        model = model_from_args(args)
        hw = load_hardware(args.hardware)
        documents, packing = _packing(args)
        wl = Workload(args.seq_length, args.block_size, args.global_batch_size, args.window_exchange,
                      2 if args.grad_reduce_in_bf16 else 4, args.logits_bytes, args.loss_chunk_rows,
                      args.objective, args.dflash_max_anchors, args.dflash_doc_length, args.dflash_vocab_chunk,
                      documents, lora=LoRAPlan(args.lora_rank, tuple(args.lora_target_modules), args.lora_dropout)
                      if args.lora_rank else None)
        if args.objective == "dflash" and not 1 <= args.dflash_max_anchors < args.seq_length:
            raise ValueError(f"--dflash-max-anchors {args.dflash_max_anchors} must be in [1, --seq-length - 1]")
        result = plan(model, wl, args.gpus, args.gpus_per_node, hw, baseline=args.baseline, only=args.layouts,
                      transports=args.transports, schedules=args.block_ownership, recompute=args.recompute,
                      distributed_optimizer=not args.no_distributed_optimizer)
        if packing:
            result["packing"] = packing
    except ValueError as e:
        report(str(e))
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
    elif result["layouts"] or result.get("layouts_not_fitting"):
        print(format_table(result, args.top))
    if not result["layouts"]:  # nothing to run: a script must not go on as if a layout had been found
        report(f"no layout fits in memory ({result['evaluated']} layouts evaluated for {args.gpus} GPUs, "
               f"--seq-length {args.seq_length}): more GPUs, --recompute full, or a shorter sequence")
        return 1
    return 0
