"""Long-context benchmark on CPU ranks: one training step of a tiny GPT (2 layers, hidden 64) under
single, CP and CSBP (P = 2) from 2K to 32K tokens, the tiled kernel (row-vector masks, memory
linear in the rows) against the math kernel (dense [rows x keys] scores and mask per partial,
what every partial did before), the latter only at lengths where it fits.

`python -m megatron_csbp.bench --long-context` (defaults below; `--seq-lengths`, `--old-max-length`,
`--sizes 1` or `--sizes 2` for one world only; `--from-json X.records.jsonl` renders what a run
wrote so far, or several runs' records concatenated).

Per (kernel, layout, L) and rank it records
- the step time (`Trainer.train_step`: forward, backward, DDP's gradient sum, Adam; one untimed
  warm step for L <= `warm_max_length`, then one timed step),
- the tensor peak and RSS high-water of one more, tracked step (`bench.memory`),
- the mask's allowed pairs on the rank (every partial of its plan, from row vectors) and the
  query x key rectangle the kernels were handed,
- attention time: one layer's block attention (exchange included) forward + backward on the rank's
  plan with random q, k, v, timed alone; per allowed pair it should stay flat over L.
Targets (issue 13): tensor peak linear in L (increase 16K->32K at most 2.3x the increase 8K->16K)
and attention time following the allowed pairs. Report: `long_context.md` / `.json` / `_memory.png`.
"""
from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron_csbp.bench.cases import BenchModel, Case, cases_for
from megatron_csbp.bench.memory import step_memory
from megatron_csbp.bench.report import load, pyplot, save_figure, write_file, write_out
from megatron_csbp.bench.worker import bench_trainer, process_groups, slowest_rank_s
from megatron_csbp.layout.rows import PartialMask


@dataclass(frozen=True)
class LongContextConfig:
    model: BenchModel = BenchModel(num_layers=2, hidden_size=64, num_attention_heads=2, num_query_groups=1,
                                   ffn_hidden_size=256, vocab_size=512, block_size=64)
    seq_lengths: Tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
    kernels: Tuple[str, ...] = ("tiled", "math")
    old_kernel: str = "math"
    old_max_length: int = 4096  # the dense path: 8 GiB per rank at 8K before issue 13
    warm_max_length: int = 8192
    P: int = 2
    worlds: Tuple[int, ...] = (1, 2)  # world sizes to run (1: single; P: CP and CSBP)
    layouts: Tuple[str, ...] = ("single", "cp-allgather", "csbp-allgather")
    seed: int = 1234

    def cases(self, world: int) -> List[Case]:
        """The layouts of a world of `world` ranks: single on one rank, CP and CSBP on P."""
        return [c for c in cases_for(world) if c.name in self.layouts] if world in (1, self.P) else []

    def lengths(self, kernel: str) -> List[int]:
        return [L for L in self.seq_lengths if kernel != self.old_kernel or L <= self.old_max_length]


def _pairs(plan, count) -> int:
    """`count(mask)` summed over the partial masks the plan keeps; the block-diagonal one counts
    every noisy row against its whole block of B."""
    total = 0
    for key, value in plan._cache.items():
        mask = value[0] if isinstance(value, tuple) else value
        if isinstance(mask, PartialMask):
            total += plan.num_noisy * mask.shape[0] if key[0] == "block_diagonal" else count(mask)
    return total


def _rectangle(mask) -> int:
    """The query x key rectangle a kernel is handed for `mask`."""
    return mask.shape[0] * mask.shape[1]


def _attention_step(model, plan, kernel_name: str, batch: int, seed: int, **kw):
    """One layer's block attention forward + backward on the plan's rows, random q, k, v (drawn
    from `seed`, `batch` samples): a function to time."""
    from megatron_csbp.attention.block_attention import block_diffusion_attention
    from megatron_csbp.attention.kernels.registry import get_kernel

    gen = torch.Generator().manual_seed(seed)
    H, G, d = model.num_attention_heads, model.num_query_groups, model.head_dim
    q, k, v = (torch.randn(len(plan.local), batch, heads, d, generator=gen, requires_grad=True) for heads in (H, G, G))
    kernel = get_kernel(kernel_name, q.device)
    return lambda: (block_diffusion_attention(q, k, v, plan, softmax_scale=d ** -0.5, kernel=kernel, **kw)
                    .sum().backward())


def _measure(cfg: LongContextConfig, case: Case, kernel_name: str, L: int) -> Dict:
    from megatron_csbp.parallel import state as bps

    m = replace(cfg.model, attention_kernel=kernel_name)
    shard_rank, shard_group = bps.get_shard_rank(), bps.get_shard_group()
    trainer = bench_trainer(m, case, L, cfg.seed)

    def step(i: int) -> float:  # the trainer's step (its loss: the global one, summed over ranks)
        return trainer.train_step(i * m.micro_batch_size).loss

    first_step_s, _, loss0 = slowest_rank_s(lambda: step(0), shard_group)  # builds the masks and tile schedules
    step_s = slowest_rank_s(lambda: step(1), shard_group)[0] if L <= cfg.warm_max_length else first_step_s
    peak, static, rss = step_memory(lambda: step(2), shard_group)
    plan = trainer.model.bdlm.plan
    allowed, rect, mask_bytes = _pairs(plan, PartialMask.allowed_pairs), _pairs(plan, _rectangle), plan.nbytes()
    attn_s = slowest_rank_s(_attention_step(m, plan, kernel_name, m.micro_batch_size, 7, layer=1), shard_group)[0]
    record = {"case": case.name, "kind": case.kind, "P": case.shard_group_size, "kernel": kernel_name, "seq_length": L,
              "shard_rank": shard_rank, "rows": len(plan.local), "first_step_s": first_step_s, "step_s": step_s,
              "warm": L <= cfg.warm_max_length, "loss_step0": loss0, "loss_step0_global": True,
              "peak_tensor_bytes": peak, "static_tensor_bytes": static, "rss_high_water_bytes": rss, "allowed_pairs": allowed,
              "kernel_rectangle_pairs": rect, "mask_bytes": mask_bytes, "attention_s": attn_s}
    del trainer, plan
    gc.collect()
    return record


def attention_scaling(cfg: LongContextConfig) -> List[Dict]:
    """Thread CPU time (insensitive to other jobs on a shared machine, unlike wall time) of one
    layer's block attention forward + backward on the single-rank plan, per kernel and L: the
    tiled kernel's time per allowed pair should stay flat, the math kernel's follows the
    rectangle. Also the pairs the tiled kernel's tiles cover. Best of 2 below 16K."""
    from megatron_csbp.attention.block_attention import plan_for_layout
    from megatron_csbp.attention.kernels.tiled import tile_schedule
    from megatron_csbp.bench.kernel_rate import best_cpu_s
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry

    torch.set_num_threads(1)
    out = []
    for kernel_name in cfg.kernels:
        for L in cfg.lengths(kernel_name):
            plan = plan_for_layout(SequenceLayout(BlockGeometry(L, cfg.model.block_size)), 0)
            step = _attention_step(cfg.model, plan, kernel_name, 1, L)  # the plan holds all 2L rows
            best = best_cpu_s(step, 2 if L < 16384 else 1)
            allowed, rect = _pairs(plan, PartialMask.allowed_pairs), _pairs(plan, _rectangle)
            computed = _pairs(plan, lambda mask: tile_schedule(mask).computed_pairs)
            out.append({"kernel": kernel_name, "seq_length": L, "attention_cpu_s": best, "allowed_pairs": allowed,
                        "kernel_rectangle_pairs": rect, "tiled_computed_pairs": computed})
            print(f"[long-context] attention {kernel_name} L={L}: {best:.2f} s CPU, "
                  f"{best / allowed * 1e9:.1f} ns per allowed pair")
            del step, plan
            gc.collect()
    return out


def world_main(rank: int, world_size: int, cfg: LongContextConfig, jobs: List[Tuple[str, str]], out_path: str):
    """All (kernel, layout) jobs of this world size, every length; records appended to
    `out_path` as they finish (rank 0 writes every rank's record: a killed run keeps its rows)."""
    import warnings

    warnings.filterwarnings("ignore")
    for kernel_name, case_name in jobs:
        case = next(c for c in cfg.cases(world_size) if c.name == case_name)
        with process_groups(case):
            for L in cfg.lengths(kernel_name):
                rec = _measure(cfg, case, kernel_name, L)
                gathered = [None] * world_size
                dist.all_gather_object(gathered, rec)
                if rank == 0:
                    with open(out_path, "a") as f:
                        f.writelines(json.dumps(r) + "\n" for r in gathered)
                    print(f"[long-context] {kernel_name} {case_name} L={L}: step {rec['step_s']:.1f} s, "
                          f"peak {max(r['peak_tensor_bytes'] for r in gathered) / 2**20:.0f} MiB", flush=True)


def run(cfg: LongContextConfig, records_path: str) -> List[Dict]:
    from megatron_csbp.parallel.spawn import spawn

    for world in cfg.worlds:
        jobs = [(k, c.name) for k in cfg.kernels for c in cfg.cases(world)]
        if not jobs:
            continue
        print(f"[long-context] world of {world}: {jobs}")
        spawn(world_main, world, cfg, jobs, records_path, attempts=1)
    return load_records(records_path)


def load_records(path: str) -> List[Dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


#: record fields summarized as their largest value over the ranks
_WORST_OF_RANKS = ("step_s", "first_step_s", "peak_tensor_bytes", "rss_high_water_bytes", "allowed_pairs",
                   "kernel_rectangle_pairs", "mask_bytes", "attention_s")


def summarize(records: List[Dict]) -> List[Dict]:
    """One row per (kernel, case, L): max over ranks of memory and time, pairs of the worst rank."""
    key = itemgetter("kernel", "case", "seq_length")
    rows = []
    for (kernel, case, L), group in groupby(sorted(records, key=key), key):
        rs = list(group)
        worst = {k: max(r[k] or 0 for r in rs) for k in _WORST_OF_RANKS}
        rows.append({
            "kernel": kernel, "case": case, "P": rs[0]["P"], "seq_length": L, "warm": rs[0]["warm"], **worst,
            # the trainer's loss is the global one; records from before it hold each rank's share
            "loss_step0": rs[0]["loss_step0"] if rs[0].get("loss_step0_global") else sum(r["loss_step0"] for r in rs),
        })
    return rows


def linearity(rows: List[Dict], kernel: str = "tiled") -> Dict[str, Dict]:
    """Per case: (peak 32K - peak 16K) / (peak 16K - peak 8K); linear memory gives 2.0."""
    out = {}
    for case in sorted({r["case"] for r in rows if r["kernel"] == kernel}):
        peak = {r["seq_length"]: r["peak_tensor_bytes"] for r in rows if r["kernel"] == kernel and r["case"] == case}
        if all(L in peak for L in (8192, 16384, 32768)):
            ratio = (peak[32768] - peak[16384]) / max(1, peak[16384] - peak[8192])
            out[case] = {"ratio": ratio, "target": 2.3, "ok": ratio <= 2.3}
    return out


def render(result: Dict) -> str:
    rows, cfg, env = result["rows"], result["config"], result["environment"]
    m = cfg["model"]
    lines = [
        "# Long-context benchmark (CPU ranks)", "",
        f"Made by `{result['command']}` on {env['date_utc']} UTC ({env['host_cpus']} shared cores, load average at "
        f"start {env['load_average_at_start']}, torch {env['torch']}, one thread per rank).",
        "",
        f"One training step of a {m['num_layers']}-layer GPT (hidden {m['hidden_size']}, {m['num_attention_heads']} "
        f"heads, {m['num_query_groups']} KV group, block {m['block_size']}, micro-batch {m['micro_batch_size']}) with "
        f"the BD3-LM objective, P = {cfg['P']} for CP and CSBP. `tiled`: row-vector masks and the tiled kernel (this "
        f"code's CPU default); `math`: the dense reference kernel ([rows x keys] mask and scores per partial, as every "
        f"partial was computed before issue 13), run up to L = {cfg['old_max_length']} only. Memory is per rank (max over "
        "ranks): tensor peak of the step (`bench.memory`, the CPU analogue of max_memory_allocated) and RSS "
        "high-water. Allowed pairs: the worst rank's mask, summed over its partials; attention: one layer's block "
        "attention forward + backward alone (exchange included), max over ranks. Step times on a machine shared "
        "with other jobs: compare shapes, not absolute values; steps marked * are first steps (plan building "
        "included, no warm-up).",
        "",
        "| kernel | layout | L | step (s) | tensor peak (MiB) | RSS (MiB) | allowed pairs (M) | kernel rectangle (M) "
        "| mask bytes (KiB) | attention (s) | ns / allowed pair |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['kernel']} | {r['case']} | {r['seq_length']} | {r['step_s']:.2f}{'' if r['warm'] else '*'} | "
              f"{r['peak_tensor_bytes'] / 2**20:.0f} | {r['rss_high_water_bytes'] / 2**20:.0f} | "
              f"{r['allowed_pairs'] / 1e6:.1f} | {r['kernel_rectangle_pairs'] / 1e6:.1f} | "
              f"{r['mask_bytes'] / 1024:.0f} | {r['attention_s']:.2f} | "
              f"{r['attention_s'] / max(1, r['allowed_pairs']) * 1e9:.1f} |" for r in rows]
    scaling = result.get("attention_scaling")
    if scaling:
        lines += ["", "Attention alone, single rank (one layer, forward + backward, thread CPU time: other jobs on "
                  "the machine barely move it), with the pairs the tiled kernel's occupied tiles cover:", "",
                  "| kernel | L | CPU s | allowed pairs (M) | tiles cover (M) | rectangle (M) | ns / allowed pair "
                  "| ns / rectangle pair |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['kernel']} | {r['seq_length']} | {r['attention_cpu_s']:.2f} | "
                  f"{r['allowed_pairs'] / 1e6:.1f} | {r['tiled_computed_pairs'] / 1e6:.1f} | "
                  f"{r['kernel_rectangle_pairs'] / 1e6:.1f} | {r['attention_cpu_s'] / r['allowed_pairs'] * 1e9:.1f} | "
                  f"{r['attention_cpu_s'] / r['kernel_rectangle_pairs'] * 1e9:.1f} |" for r in scaling]
    lin = result.get("linearity", {})
    if lin:
        lines += ["", "Memory linearity (tiled): (peak 32K - peak 16K) / (peak 16K - peak 8K), linear = 2.0, "
                  "target <= 2.3:", ""]
        lines += [f"- {case}: {v['ratio']:.2f} ({'ok' if v['ok'] else 'MISSED'})" for case, v in lin.items()]
    if result.get("notes"):
        lines += [""] + result["notes"]
    lines.append("")
    return "\n".join(lines)


def plot(result: Dict, path: str) -> None:
    plt = pyplot()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (kernel, case) in sorted({(r["kernel"], r["case"]) for r in rows}):
        rs = sorted((r for r in rows if r["kernel"] == kernel and r["case"] == case), key=lambda r: r["seq_length"])
        xs = [r["seq_length"] for r in rs]
        style = "-o" if kernel == "tiled" else "--x"
        axes[0].plot(xs, [r["peak_tensor_bytes"] / 2**30 for r in rs], style, label=f"{kernel} {case}")
        if not result.get("attention_scaling"):
            axes[1].plot(xs, [r["attention_s"] / max(1, r["allowed_pairs"]) * 1e9 for r in rs], style,
                         label=f"{kernel} {case}")
    title = "Attention wall time / allowed pairs"
    for kernel in sorted({r["kernel"] for r in result.get("attention_scaling") or []}):
        rs = [r for r in result["attention_scaling"] if r["kernel"] == kernel]
        for key, alpha, what in (("allowed_pairs", None, "allowed"), ("kernel_rectangle_pairs", 0.4, "rectangle")):
            axes[1].plot([r["seq_length"] for r in rs], [r["attention_cpu_s"] / r[key] * 1e9 for r in rs],
                         "-o" if kernel == "tiled" else "--x", alpha=alpha, label=f"{kernel}, per {what} pair")
        title = "One layer's attention (single rank, CPU time)"
    axes[0].set(xscale="log", xlabel="L (tokens)", ylabel="tensor peak per rank (GiB)", title="Peak memory per rank")
    axes[1].set(xscale="log", yscale="log", xlabel="L (tokens)", ylabel="attention ns per pair", title=title)
    for ax in axes:
        ax.set_xticks(sorted({r["seq_length"] for r in rows}))
        ax.get_xaxis().set_major_formatter(ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def save(result: Dict, output_dir: str, name: str, with_plots: bool) -> Dict[str, str]:
    files = write_out(os.path.join(output_dir, name), result, render(result), echo=False)
    if with_plots:
        files["plot"] = os.path.join(output_dir, f"{name}_memory.png")
        plot(result, files["plot"])
    return files


def main(args, command: str) -> Dict[str, str]:
    """`python -m megatron_csbp.bench --long-context ...`: what it wrote, by kind."""
    from megatron_csbp.bench.runner import environment

    given = {"seq_lengths": args.seq_lengths and tuple(args.seq_lengths), "old_max_length": args.old_max_length,
             "worlds": args.sizes and tuple(args.sizes)}
    cfg = LongContextConfig(**{k: v for k, v in given.items() if v is not None and v != []})
    name = args.name or "long_context"
    os.makedirs(args.output_dir, exist_ok=True)
    if args.from_json and args.from_json.endswith(".jsonl"):  # records of a run that did not finish
        result = {"config": asdict(cfg), "environment": environment(), "command": command + " (partial records)",
                  "records": load_records(args.from_json)}
    elif args.from_json:
        result = load(args.from_json)
    elif not args.attention_scaling:
        records_path = os.path.join(args.output_dir, f"{name}.records.jsonl")
        Path(records_path).unlink(missing_ok=True)
        env, t0 = environment(), time.perf_counter()
        records = run(cfg, records_path)
        result = {"config": asdict(cfg), "environment": dict(env, wall_s=time.perf_counter() - t0), "command": command,
                  "records": records}
    scaling_path = os.path.join(args.output_dir, f"{name}_attention.json")
    if args.attention_scaling:
        write_file(scaling_path, attention_scaling(cfg))
        if not args.from_json:
            return {"attention scaling": scaling_path}
    if os.path.exists(scaling_path) and "attention_scaling" not in result:
        result["attention_scaling"] = load(scaling_path)
    result["rows"] = summarize(result["records"])
    result["linearity"] = linearity(result["rows"])
    return save(result, args.output_dir, name, with_plots=not args.no_plots)
