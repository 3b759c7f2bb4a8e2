"""Markdown table, JSON and PNG plots of a benchmark run."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Dict, List, Optional

MiB = 2 ** 20


def _fmt(x, spec=".2f", scale=1):
    return "–" if x is None else format(x * scale, spec)


def _ratio(x):
    return "–" if x is None else f"{x:.2f}x"


def _made_by(title: str, command: str) -> List[str]:
    return [f"# {title}", "", "Made by:", "", "```", command, "```", ""]


def _step_bullet(cfg: Dict) -> str:
    return (f"- step = forward + backward + one all-reduce of parameter gradients over the shard group + "
            f"optimizer step; {cfg['warmup']} warm-up steps, then the median of {cfg['steps']} steps, each timed "
            "as the slowest rank's step.")


def _machine_bullet(env: Dict) -> str:
    return (f"- machine: {env['host_cpus']} CPUs shared with other jobs (load average at start "
            f"{_fmt(env['load_average_at_start'][0] if env.get('load_average_at_start') else None)}), one thread "
            f"per rank, gloo; torch {env['torch']}; {env['date_utc']} UTC; the whole run took {env['wall_s']:.0f} s.")


def bench_parser(module: str, description: str, raw: bool = False):
    """The parser of `python -m megatron_csbp.bench.MODULE` (one-line errors); library warnings hidden."""
    from megatron_csbp.utils.cli import ArgumentParser, filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    return ArgumentParser(prog=f"python -m megatron_csbp.bench.{module}", description=description,
                          formatter_class=argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> str:
    """Lay out, write (PNG, 110 dpi) and close a matplotlib figure; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


_TRAFFIC = ("- traffic: logical bytes each rank *sends* in attention collectives per step (forward + backward, all "
            "layers): the sizes of the tensors handed to the collectives, from "
            "`megatron_csbp.attention.accounting.traffic_counter()` (equal to the bytes counted at the "
            "process-group layer: `tests/test_traffic_collectives.py`)")


def _loss_sentence(rows: List[Dict], same: str) -> List[str]:
    """The largest step-0 loss deviation from the single rank's, as a paragraph ([] without a single rank)."""
    devs = [d for d in (loss_vs_single(r, rows) for r in rows if r["kind"] != "single") if d is not None]
    return [f"Step-0 loss of every layout vs the single-rank loss {same} (same weights, tokens and noise): "
            f"largest relative difference {max(devs):.1e}.", ""] if devs else []


def _paragraph(lines: List[str], head: List[str] = ()) -> List[str]:
    """`head`, `lines` and a blank line; nothing without `lines`."""
    return [*head, *lines, ""] if lines else []


def markdown(result: Dict, command: str, plots: Dict[str, str]) -> str:
    """The report of a run (GPT or DiffusionGemma), its plots linked at the end."""
    diffusiongemma = result["config"]["model"].get("arch") == "diffusiongemma-hybrid"
    out = (_markdown_diffusiongemma if diffusiongemma else _markdown_gpt)(
        result["config"], result["environment"], result["rows"], command)
    out += _paragraph([f"![{name}]({os.path.basename(path)})" for name, path in plots.items()], ["## Plots", ""])
    return "\n".join(out)


def _markdown_gpt(cfg: Dict, env: Dict, rows: List[Dict], command: str) -> List[str]:
    m = cfg["model"]
    head_dim = m["hidden_size"] // m["num_attention_heads"]
    out = _made_by("CPU benchmark: single rank, CP, BP and CSBP", command) + [
        f"- model: Megatron GPTModel (local spec, block-diffusion core attention, RoPE), {m['num_layers']} layers, "
        f"hidden {m['hidden_size']}, {m['num_attention_heads']} heads, G = {m['num_query_groups']} KV groups of "
        f"d = {head_dim}, FFN {m['ffn_hidden_size']}, vocab {m['vocab_size']}, block size {m['block_size']}, "
        f"micro-batch {m['micro_batch_size']}, {m['dtype']}; BD3-LM objective; AdamW.",
        _step_bullet(cfg),
        _TRAFFIC + "; received bytes are equal. The formula "
        "column is the design brief's per-layer `8*L*G*d*s*(P-1)/P` (CP) and `4*L*G*d*s*(C-1)/C` (CSBP, ring of "
        "C ranks) times layers.",
        "- memory: peak live tensor bytes of one extra (untimed) step per rank, with weights, gradients, "
        "optimizer states and cached masks (see `megatron_csbp/bench/memory.py`); the table shows the largest "
        "rank. The process RSS high-water mark (after `/proc/self/clear_refs`) is in the JSON file; it is "
        "dominated by the ~0.4 GiB of libraries and is not compared.",
        "- ratios are to CP over the same ranks with the same transport (BP: to CP all-gather).",
        "- exposed comm: the slowest rank's median seconds per step spent waiting on attention collectives "
        "(inside the wait of a collective started earlier, or the whole of a blocking one: "
        "`TrafficCounter.waited_s`). in flight: the slowest rank's median seconds per step from posting each "
        "attention collective to the end of its wait (the whole time of a blocking one); hidden = in flight - "
        "exposed, the share hidden is 1 - (sum of exposed) / (sum of in flight) over the ranks. The ring starts "
        "each shift before attending the chunk in hand; its backward shifts and the all-gather's reduce-scatter "
        "block (nothing hidden).",
        "- CPU ms: the CPU time of a rank's main thread in the step (`time.thread_time()`, median over the timed "
        "steps, largest rank). Other jobs on the shared cores stretch wall time but not CPU time; a rank blocked "
        "in a wait uses none. CPU vs CP compares it with CP over the same ranks and transport.",
        _machine_bullet(env) + " Worlds of 4 ranks run on 2 cores, so their times carry oversubscription; "
        "compare layouts within one P.",
        "",
    ]
    for P in sorted({r["P"] for r in rows}):
        out += [f"## P = {P}" if P > 1 else "## Single rank", ""]
        out += ["| L | layout | CP | BP | step ms | CPU ms | CPU vs CP | comm in flight ms | exposed comm ms "
                "| hidden | tok/s | time vs CP | attn logical MiB sent/rank "
                "| vs CP | formula MiB | measured/formula | peak MiB (max rank) | vs CP | loss step 0 |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted((r for r in rows if r["P"] == P), key=lambda r: r["seq_length"]):
            mf = (r["attn_bytes_sent"] / r["formula_bytes_sent"]) if r["formula_bytes_sent"] else None
            hidden = _fmt(r.get("hidden_comm_share"), ".0%")
            ms = [_fmt(r.get(key), ".1f", 1e3) for key in ("thread_cpu_s", "in_flight_comm_s", "exposed_comm_s")]
            out.append(
                f"| {r['seq_length']} | {r['case']} | {r['cp']} | {r['bp']} | {r['median_step_s'] * 1e3:.1f} | "
                f"{ms[0]} | {_ratio(r.get('cpu_vs_cp'))} | {ms[1]} | {ms[2]} | {hidden} | {r['tokens_per_s']:.0f} | "
                f"{_ratio(r['time_vs_cp'])} | {r['attn_bytes_sent'] / MiB:.3f} | {_ratio(r['traffic_vs_cp'])} | "
                f"{r['formula_bytes_sent'] / MiB:.3f} | {_fmt(mf, '.3f')} | "
                f"{_peak_mib(r)} | {_ratio(r['memory_vs_cp'])} | {r['loss_step0']:.6f} |")
        out.append("")
    full = [r for r in rows if r["kind"] == "csbp" and r["cp"] == r["P"] and r["traffic_vs_cp"] is not None]
    if full:
        worst = max(r["traffic_vs_cp"] for r in full)
        out += [f"CSBP (CP = BP = P) traffic vs CP, every case above: at most {worst:.3f}x "
                f"({'half or less' if worst <= 0.5 + 1e-12 else 'MORE THAN HALF'}).", ""]
    out += _loss_sentence(rows, "at the same L")
    return out + _hidden_summary(rows) + _cpu_summary(rows) + _memory_vs_cp(rows) + _memory_table(rows)


def _peak_mib(r: Dict) -> str:
    return _fmt(r["peak_tensor_bytes"] / MiB if r["peak_tensor_bytes"] else None, ".1f")


def loss_vs_single(r: Dict, rows: List[Dict]) -> Optional[float]:
    """|loss - single-rank loss| / |single-rank loss| of one case (same L, and for DiffusionGemma
    the same attention variant); None without a single-rank case."""
    ref = next((x["loss_step0"] for x in rows if x["kind"] == "single" and x["seq_length"] == r["seq_length"]
                and x.get("attention") == r.get("attention")), None)
    return None if ref is None else abs(r["loss_step0"] - ref) / abs(ref)


def by_case(rows: List[Dict]) -> Dict[tuple, Dict]:
    """The rows by (P, L, case name)."""
    return {(r["P"], r["seq_length"], r["case"]): r for r in rows}


def dg_headline(rows: List[Dict]) -> List[Dict]:
    """Per (P, L): CSBP/CP bytes on the hybrid model, on full attention, their ratio, and CSBP/CP
    step time and peak memory for both."""
    index = by_case(rows)
    out = []
    for P, L in sorted({(r["P"], r["seq_length"]) for r in rows if r["P"] > 1}):
        h, f = index.get((P, L, "csbp-hybrid")), index.get((P, L, "csbp-full"))
        if h is None or f is None:
            continue
        hb, fb = h["traffic_vs_cp"], f["traffic_vs_cp"]
        out.append({"P": P, "seq_length": L, "bytes_hybrid": hb, "bytes_full": fb,
                    "bytes_ratio_of_ratios": (fb / hb) if hb and fb is not None else None,
                    "time_hybrid": h["time_vs_cp"], "time_full": f["time_vs_cp"],
                    "memory_hybrid": h["memory_vs_cp"], "memory_full": f["memory_vs_cp"]})
    return out


def _markdown_diffusiongemma(cfg: Dict, env: Dict, rows: List[Dict], command: str) -> List[str]:
    m = cfg["model"]
    types = ["F" if (i + 1) % m["full_every"] == 0 else "S" for i in range(m["num_layers"])]
    out = _made_by("CPU benchmark: DiffusionGemma hybrid (sliding : full) layers, single rank, CP and CSBP",
                   command) + [
        f"- model: tiny DiffusionGemma in megatron-core (`diffusion_gemma_model`, MoE MLP with "
        f"{m['num_moe_experts']} experts top-{m['moe_router_topk']}), {m['num_layers']} layers "
        f"`[{','.join(types)}]` (S = sliding window {m['sliding_window']}, F = full), hidden {m['hidden_size']}, "
        f"{m['num_attention_heads']} query heads; sliding layers {m['num_query_groups']} KV heads x "
        f"{m['kv_channels']} ({2 * m['num_query_groups'] * m['kv_channels']} K+V values per row), the full layer "
        f"{m['full_num_query_groups']} KV head x {m['full_kv_channels']} with K = V (CSBP moves raw k alone "
        f"there, {m['full_num_query_groups'] * m['full_kv_channels']} values per row); vocab {m['vocab_size']}, "
        f"block size {m['block_size']}, token-causal clean stream, micro-batch {m['micro_batch_size']}, "
        f"{m['dtype']}; weights from `redraw_weights(model, {cfg['seed']})`; BD3-LM objective; AdamW.",
        "- `hybrid`: the windows as configured; `full`: the same weights with every layer full attention "
        "(each `BlockDiffusionAttention.window = None`).",
        "- layouts: single rank, CP (all-gather of K and V on every layer; windows only mask) and CSBP with "
        "CP = BP = P (all-gather of the clean rows on full-attention layers, the windowed all-to-all on sliding "
        "layers).",
        _step_bullet(cfg),
        _TRAFFIC + "; the table shows the largest rank. Formula: "
        "per layer `8*L*G*d*s*(P-1)/P` (CP, K and V on every layer), `4*L*G*d*s*(C-1)/C` (CSBP, full attention) "
        "and half of that on the K=V layer; CSBP's windowed sliding layers have no closed formula (–).",
        "- memory: peak live tensor bytes of one extra (untimed) step per rank (`megatron_csbp/bench/memory.py`), "
        "largest rank.",
        _machine_bullet(env),
        "",
    ]
    head = dg_headline(rows)
    if head:
        out += ["## Headline: CSBP / CP", "",
                "| P | L | bytes, hybrid | bytes, full attention | full / hybrid | step time, hybrid | "
                "step time, full | peak memory, hybrid | peak memory, full |",
                "|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {h['P']} | {h['seq_length']} | {_fmt(h['bytes_hybrid'], '.4f')} | {_fmt(h['bytes_full'], '.4f')} | "
                f"{_fmt(h['bytes_ratio_of_ratios'], '.1f')}x | {_ratio(h['time_hybrid'])} | {_ratio(h['time_full'])} | "
                f"{_ratio(h['memory_hybrid'])} | {_ratio(h['memory_full'])} |" for h in head] + [""]
    out += ["## Cases", "",
            "| L | case | attention | CP | BP | step ms | time vs CP | attn logical bytes sent/rank | vs CP | formula bytes "
            "| peak MiB (max rank) | vs CP | loss step 0 | vs single |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["seq_length"], r["attention"] != "hybrid", r["P"], r["bp"])):
        dev = loss_vs_single(r, rows) if r["kind"] != "single" else None
        out.append(
            f"| {r['seq_length']} | {r['case']} | {r['attention']} | {r['cp']} | {r['bp']} | "
            f"{r['median_step_s'] * 1e3:.1f} | {_ratio(r['time_vs_cp'])} | {r['attn_bytes_sent']:,} | "
            f"{_fmt(r['traffic_vs_cp'], '.4f')} | "
            f"{_fmt(r['formula_bytes_sent'], ',')} | {_peak_mib(r)} | {_ratio(r['memory_vs_cp'])} | "
            f"{r['loss_step0']:.6f} | {_fmt(dev, '.1e')} |")
    out.append("")
    out += ["## Logical bytes sent per layer (rank 0)", "",
            "| L | case | " + " | ".join(f"layer {i + 1} ({t})" for i, t in enumerate(types)) + " |",
            "|---|---|" + "---|" * len(types)]
    for r in sorted((r for r in rows if r["P"] > 1), key=lambda r: (r["seq_length"], r["attention"] != "hybrid",
                                                                     r["bp"])):
        per, formula = r["attn_bytes_sent_per_layer_per_rank"][0], r["formula_bytes_per_layer"]
        cells = [_vs_formula(per.get(str(i), 0), formula.get(str(i))) for i in range(1, len(types) + 1)]
        out.append(f"| {r['seq_length']} | {r['case']} | " + " | ".join(cells) + " |")
    out.append("")
    return out + _loss_sentence(rows, "of the same model and L")


def _vs_formula(got: int, want: Optional[int]) -> str:
    return f"{got:,}" + ("" if want is None else " (= formula)" if got == want else f" (formula {want:,})")


def _hidden_summary(rows: List[Dict]) -> List[str]:
    """One sentence per transport: how much of the attention communication compute hid."""
    out = []
    for transport in ("ring", "allgather"):
        sel = [r for r in rows if r["P"] > 1 and r["transport"] == transport and r["kind"] in ("cp", "csbp")
               and r.get("hidden_comm_share") is not None]
        if not sel:
            continue
        shares = sorted(r["hidden_comm_share"] for r in sel)
        timing = [t for r in sel for t in r["timing_per_rank"]]
        inflight, exposed = (sum(t[key] for t in timing) for key in ("in_flight_comm_s", "exposed_comm_s"))
        fwd = [t for t in timing if "forward_in_flight_comm_s" in t]
        fwd_in = sum(t["forward_in_flight_comm_s"] for t in fwd)
        fwd_share = (f"; forward collectives alone (backward ones block): "
                     f"{100 * (1 - sum(t['forward_exposed_comm_s'] for t in fwd) / fwd_in):.0f}%") if fwd_in else ""
        out.append(f"Hidden communication, {transport} transport (CP and CSBP cases): of the time attention "
                   f"collectives were in flight (all ranks, all cases), {100 * (1 - exposed / inflight):.0f}% was "
                   f"covered by compute (per case {100 * shares[0]:.0f}% to {100 * shares[-1]:.0f}%, median "
                   f"{100 * shares[len(shares) // 2]:.0f}%){fwd_share}.")
    return _paragraph(out)


def _cpu_summary(rows: List[Dict]) -> List[str]:
    """CSBP vs CP in CPU time per step at the shortest L, per P and transport."""
    out = []
    Lmin = min((r["seq_length"] for r in rows), default=None)
    for r in sorted(rows, key=lambda r: (r["P"], r["case"])):
        if r["seq_length"] != Lmin or r["kind"] != "csbp" or r["cp"] != r["P"] or r.get("cpu_vs_cp") is None:
            continue
        out.append(f"- L = {Lmin}, P = {r['P']}, {r['case']}: CPU time per step {r['thread_cpu_s'] * 1e3:.1f} ms, "
                   f"{r['cpu_vs_cp']:.2f}x CP's ({'not slower' if r['cpu_vs_cp'] <= 1.0 else 'SLOWER'}); wall "
                   f"{_ratio(r['time_vs_cp'])}.")
    return _paragraph(out, ["CSBP vs CP at the shortest length, CPU time of the largest rank (robust to the shared "
                            "machine's load):", ""])


def memory_vs_cp(rows: List[Dict], min_length: int = 2048) -> List[Dict]:
    """CSBP (CP = BP = P) peak tensor memory per rank against CP with the same transport, every case
    from `min_length` on: the issue's claim (CSBP <= CP)."""
    index = by_case(rows)
    out = []
    for r in sorted(rows, key=lambda r: (r["P"], r["seq_length"], r["case"])):
        if r["kind"] != "csbp" or r["cp"] != r["P"] or r["seq_length"] < min_length or not r.get("peak_tensor_bytes"):
            continue
        cp = index.get((r["P"], r["seq_length"], r["baseline"]))
        if cp is None or not cp.get("peak_tensor_bytes"):
            continue
        out.append({"P": r["P"], "seq_length": r["seq_length"], "case": r["case"], "transport": r["transport"],
                    "cp_bytes": cp["peak_tensor_bytes"], "csbp_bytes": r["peak_tensor_bytes"],
                    "ratio": r["peak_tensor_bytes"] / cp["peak_tensor_bytes"]})
    return out


def _memory_vs_cp(rows: List[Dict]) -> List[str]:
    cmp = memory_vs_cp(rows)
    if not cmp:
        return []
    out = ["## CSBP peak memory vs CP, same transport (L >= 2048)", "",
           "| P | L | CSBP layout | transport | CP MiB | CSBP MiB | CSBP / CP | CSBP - CP KiB |",
           "|---|---|---|---|---|---|---|---|"]
    out += [f"| {c['P']} | {c['seq_length']} | {c['case']} | {c['transport']} | {c['cp_bytes'] / MiB:.2f} | "
            f"{c['csbp_bytes'] / MiB:.2f} | {c['ratio']:.4f} | {(c['csbp_bytes'] - c['cp_bytes']) / 1024:+.0f} |"
            for c in cmp]
    worst = max(cmp, key=lambda c: c["ratio"])
    above = sum(c["ratio"] > 1.0 for c in cmp)
    verdict = ("CSBP at or below CP in every case above" if not above
               else f"CSBP ABOVE CP in {above} of the {len(cmp)} cases above")
    out += ["", f"Largest CSBP / CP: {worst['ratio']:.4f} ({worst['case']}, P = {worst['P']}, L = {worst['seq_length']}): "
            f"{verdict}.", ""]
    return out


def _memory_table(rows: List[Dict]) -> List[str]:
    if not rows or rows[0]["peak_tensor_bytes"] is None:
        return []
    Lmax = max(r["seq_length"] for r in rows)
    sel = [r for r in rows if r["seq_length"] == Lmax and r["P"] > 1]
    if not sel:
        return []
    out = [f"## Peak tensor memory per rank at L = {Lmax} (MiB)", "",
           "| P | layout | per rank | rows per rank |", "|---|---|---|---|"]
    for r in sorted(sel, key=lambda r: (r["P"], r["case"])):
        per = ", ".join(f"{b / MiB:.1f}" for b in r["peak_tensor_bytes_per_rank"])
        out.append(f"| {r['P']} | {r['case']} | {per} | {', '.join(map(str, r['rows_per_rank']))} |")
    return out + [""]


def plots(result: Dict, out_dir: str, name: str) -> Dict[str, str]:
    """PNG plots: traffic and step time vs sequence length (one panel per P), memory per rank."""
    rows = result["rows"]
    sizes = sorted({r["P"] for r in rows if r["P"] > 1})
    if not sizes:
        return {}
    files, cases = {}, list(dict.fromkeys(r["case"] for r in rows if r["P"] > 1))

    def panels():  # one axis per P
        fig, axes = pyplot().subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
        return fig, zip(axes[0], sizes)

    def line(ax, P, case, key, scale, **style):  # (L, value / scale) sorted by L, where there are values
        pts = sorted((r["seq_length"], r[key] / scale) for r in rows if r["P"] == P and r["case"] == case
                     and r[key] is not None)
        if pts:
            ax.plot(*zip(*pts), **style)

    for key, ylabel, fname, scale in (("attn_bytes_sent", "attention MiB sent per rank per step", "traffic", MiB),
                                      ("median_step_s", "median step time (ms)", "time", 1e-3)):
        fig, axes = panels()
        for ax, P in axes:
            for case in cases:
                line(ax, P, case, key, scale, marker="o", label=case)
            if key == "attn_bytes_sent":
                for case, style in (("cp-allgather", ":"), ("csbp-allgather", "--")):
                    line(ax, P, case, "formula_bytes_sent", scale, linestyle=style, color="k", linewidth=1,
                         label=f"formula ({case.split('-')[0].upper()})")
            if key == "median_step_s":
                for j, single in enumerate(dict.fromkeys(r["case"] for r in rows if r["P"] == 1)):
                    line(ax, 1, single, key, scale, marker="x", linestyle="--" if j == 0 else "-.", color="k",
                         label="single rank" if single == "single" else f"single rank ({single})")
            if key == "attn_bytes_sent" and any("attention" in r for r in rows):
                ax.set_yscale("log")  # DiffusionGemma: windowed CSBP moves ~1/30 of CP
            ax.set(title=f"P = {P}", xlabel="sequence length L (clean tokens)", ylabel=ylabel)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        files[f"{fname} vs sequence length"] = save_figure(fig, os.path.join(out_dir, f"{name}_{fname}.png"))

    if rows[0]["peak_tensor_bytes"] is not None:
        Lmax = max(r["seq_length"] for r in rows)
        fig, axes = panels()
        for ax, P in axes:
            sel = [r for r in rows if r["P"] == P and r["seq_length"] == Lmax]
            width = 0.8 / max(1, P)
            for i, r in enumerate(sel):
                for rank, b in enumerate(r["peak_tensor_bytes_per_rank"]):
                    ax.bar(i + (rank - (P - 1) / 2) * width, b / MiB, width=width,
                           color=f"C{rank}", label=f"rank {rank}" if i == 0 else None)
            ax.set_xticks(range(len(sel)), [r["case"] for r in sel], rotation=30, ha="right", fontsize=7)
            ax.set(ylabel="peak live tensor MiB", title=f"P = {P}, L = {Lmax}")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3, axis="y")
        files["peak memory per rank"] = save_figure(fig, os.path.join(out_dir, f"{name}_memory.png"))
    return files


def save(result: Dict, out_dir: str, name: str, command: str, with_plots: bool = True) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    result = dict(result, command=command)
    if result["config"]["model"].get("arch") == "diffusiongemma-hybrid":
        result["headline"] = dg_headline(result["rows"])
    figs = plots(result, out_dir, name) if with_plots else {}
    files = write_out(os.path.join(out_dir, name), result, markdown(result, command, figs), echo=False)
    return dict(figs, markdown=files["markdown"], json=files["json"])


def write_out(out: str, result, text: str, echo: bool = True) -> Dict[str, str]:
    """OUT.json (`result`) and OUT.md (`text`), then `text` printed (`echo`); returns their paths."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    files = {"json": out + ".json", "markdown": out + ".md"}
    write_file(files["json"], result)
    write_file(files["markdown"], text)
    if echo:
        print(text)
    return files


def load(path: str) -> Dict:
    return json.loads(Path(path).read_text())


def write_file(path: Optional[str], data) -> None:
    """`data` to `path`: a string as it is, anything else as JSON (indent 1); nothing without a path."""
    if path:
        Path(path).write_text(data if isinstance(data, str) else json.dumps(data, indent=1))
