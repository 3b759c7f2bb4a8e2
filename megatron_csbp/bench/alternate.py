"""Two layouts' CPU time per step, measured alternately: `python -m megatron_csbp.bench.alternate`.

    python -m megatron_csbp.bench.alternate --seq-length 1024 --size 4 --layouts cp-ring csbp-ring \\
        --pairs 6 --warmup 2 --steps 10 --count-ops

One world of `--size` gloo ranks runs the two layouts `--pairs` times, in the order A B, B A, A B,
...: drifts of a shared machine (other jobs, cache and core sharing) hit both alike. Each run is the
benchmark's step (`bench.worker`: `Trainer.train_step`, forward, backward, DDP's gradient all-reduce,
AdamW) on its model; a rank's cost is the median over `--steps` timed steps of its main thread's
CPU time (`time.thread_time()`: the time it waits is not counted). Per pair: B / A summed over the ranks
and for the largest rank; the report gives the median, the range and the median's 95 % interval
over the pairs (`median_ci`), of each rank's median step and of its fastest step. `--count-ops`
adds one step under torch.profiler per run: aten op calls per step, a counter that the machine's
load cannot change (the same in every pair).
"""
from __future__ import annotations

from collections import Counter
from itertools import accumulate
import math
import shlex
import statistics
import sys
import time
from typing import Dict, List, Sequence

from megatron_csbp.bench.cases import ALL_LAYOUTS, BenchConfig, cases_for


def alternate(cfg: BenchConfig, layouts: Sequence[str], pairs: int, log=print) -> Dict:
    """Run layouts A, B alternately `pairs` times in one world; per-pair ratios B / A."""
    (P,), (L,) = cfg.sizes, cfg.seq_lengths
    a, b = ({c.name: c for c in cases_for(P, layouts)}[n] for n in layouts)
    order = [c for i in range(pairs) for c in ((a, b) if i % 2 == 0 else (b, a))]
    from megatron_csbp.bench.runner import load_average
    from megatron_csbp.bench.worker import world_main  # one record per run: one sequence length
    from megatron_csbp.parallel.spawn import spawn

    load0 = load_average()
    t0 = time.perf_counter()
    log(f"[alternate] P = {P}, L = {L}: {pairs} pairs of {a.name} / {b.name}")
    per_rank = spawn(world_main, P, cfg, order)
    runs = []
    for i, case in enumerate(order):
        records = [per_rank[r][i] for r in range(P)]
        run = {"layout": case.name, "pair": i // 2, "thread_cpu_s": [x["thread_cpu_s"] for x in records],
               # per rank, its fastest timed step: other jobs and cache sharing only ever add time
               "thread_cpu_min_s": [min(x["thread_cpu_steps_s"]) for x in records],
               "median_step_s": records[0]["median_step_s"], "loss_step0": records[0]["loss_step0"]}
        if cfg.count_ops:
            run["ops_per_step"] = [sum(x["op_counts"].values()) for x in records]
            run["op_counts"] = dict(sum((Counter(x["op_counts"]) for x in records), Counter()))
        runs.append(run)
    return {"layouts": [a.name, b.name], "P": P, "seq_length": L, "pairs": pairs, "runs": runs,
            "summary": summary(runs, a.name, b.name),
            "environment": {"load_average_at_start": load0, "wall_s": time.perf_counter() - t0,
                            "load_average_at_end": load_average()}}


def median_ci(x: Sequence[float], level: float = 0.95):
    """Distribution-free confidence interval of the median of `x` (the pairs are independent
    draws): order statistics x_(k) and x_(n+1-k) with P(Binomial(n, 1/2) < k) <= (1 - level) / 2.
    None when n is too small for `level` (n < 6 at 95 %)."""
    n, xs = len(x), sorted(x)
    # the largest k whose lower tail P(B <= k - 1) stays within (1 - level) / 2: the tails rise with k
    tails = accumulate(math.comb(n, j) / 2 ** n for j in range(n + 1))
    k = sum(tail <= (1 - level) / 2 for tail in tails)
    return None if k == 0 else [xs[k - 1], xs[n - k]]


def summary(runs: List[Dict], a: str, b: str) -> Dict:
    """Per pair, B / A of the CPU time summed over ranks and of the largest rank; median, range,
    the median's 95 % interval. `*_min`: the same of each rank's fastest step (when recorded)."""
    pairs = sorted({r["pair"] for r in runs})
    get = {(r["pair"], r["layout"]): r for r in runs}
    stats = lambda x: {"median": statistics.median(x), "min": min(x), "max": max(x), "per_pair": x,  # noqa: E731
                       "median_ci95": median_ci(x)}
    out = {}
    for key, suffix in (("thread_cpu_s", ""), ("thread_cpu_min_s", "_min")):
        if not all(key in r for r in runs):
            continue
        out["ratio_sum" + suffix] = stats([sum(get[p, b][key]) / sum(get[p, a][key]) for p in pairs])
        out["ratio_max" + suffix] = stats([max(get[p, b][key]) / max(get[p, a][key]) for p in pairs])
    return out


def render(result: Dict, command: str, top: int = 12) -> str:
    a, b = result["layouts"]
    runs, s = result["runs"], result["summary"]
    get = {(r["pair"], r["layout"]): r for r in runs}
    fastest = "ratio_sum_min" in s  # each rank's fastest step recorded too
    lines = ["```", command, "```", "",
             f"| pair | order | {a} CPU ms (sum over ranks) | {b} CPU ms (sum) | {b} / {a} (sum) "
             f"| {a} largest rank ms | {b} largest rank ms | {b} / {a} (largest rank) |"
             + (" fastest steps: sum | largest rank |" if fastest else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if fastest else "")]
    for p, (rs, rm) in enumerate(zip(s["ratio_sum"]["per_pair"], s["ratio_max"]["per_pair"])):
        ca, cb = get[p, a]["thread_cpu_s"], get[p, b]["thread_cpu_s"]
        order = f"{a}, {b}" if p % 2 == 0 else f"{b}, {a}"
        lines.append(f"| {p} | {order} | {sum(ca) * 1e3:.1f} | {sum(cb) * 1e3:.1f} | {rs:.3f} | {max(ca) * 1e3:.1f} "
                     f"| {max(cb) * 1e3:.1f} | {rm:.3f} |"
                     + (f" {s['ratio_sum_min']['per_pair'][p]:.3f} | {s['ratio_max_min']['per_pair'][p]:.3f} |"
                        if fastest else ""))

    def stat(key):
        st = s[key]
        ci = st.get("median_ci95")
        return (f"**{st['median']:.3f}** (range {st['min']:.3f}-{st['max']:.3f}"
                + (f"; 95 % interval of the median {ci[0]:.3f}-{ci[1]:.3f}" if ci else "") + ")")

    lines += ["", f"Median over {len(s['ratio_sum']['per_pair'])} pairs of {b} / {a}, each rank's median step: "
              f"summed over ranks {stat('ratio_sum')}; largest rank {stat('ratio_max')}."]
    if fastest:
        lines.append(f"Each rank's fastest step: summed over ranks {stat('ratio_sum_min')}; "
                     f"largest rank {stat('ratio_max_min')}.")
    if "op_counts" in runs[0]:
        ca, cb = get[0, a]["op_counts"], get[0, b]["op_counts"]
        lines += ["", f"aten op calls per step, summed over ranks: {a} {sum(ca.values())}, {b} {sum(cb.values())} "
                  f"({sum(cb.values()) / sum(ca.values()):.3f}x). Largest differences:", "",
                  f"| op | {a} calls | {b} calls |", "|---|---|---|"]
        keys = sorted(set(ca) | set(cb), key=lambda k: (-abs(cb.get(k, 0) - ca.get(k, 0)), k))[:top]
        lines += [f"| {k} | {ca.get(k, 0)} | {cb.get(k, 0)} |" for k in keys]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from megatron_csbp.bench.report import bench_parser, write_file

    argv = sys.argv[1:] if argv is None else list(argv)
    p = bench_parser("alternate", __doc__, raw=True)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--size", type=int, default=4, help="ranks of the shard group (P)")
    p.add_argument("--layouts", nargs=2, default=["cp-ring", "csbp-ring"], choices=ALL_LAYOUTS,
                   help="A and B: the ratios are B / A")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--count-ops", action="store_true", help="one more step per run under torch.profiler")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE", help="write the command and the tables")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs must be >= 1, got {args.pairs}")
    if args.layouts[0] == args.layouts[1]:
        p.error(f"--layouts must name two different layouts, got {args.layouts[0]} twice")
    if args.size < 2:
        p.error(f"--size must be >= 2, got {args.size}")
    missing = [n for n in args.layouts if n not in {c.name for c in cases_for(args.size, args.layouts)}]
    if missing:
        p.error(f"--layouts {missing[0]} has no case at --size {args.size}")
    unit = 2 * args.size * BenchConfig().model.block_size
    if args.seq_length % unit:
        p.error(f"--seq-length {args.seq_length} must be a multiple of 2 x --size x block size = {unit} "
                "(zigzag chunks and balanced mirrored block pairs)")
    cfg = BenchConfig(seq_lengths=(args.seq_length,), sizes=(args.size,), layouts=tuple(args.layouts),
                      warmup=args.warmup, steps=args.steps, measure_memory=False, count_ops=args.count_ops)
    try:
        cfg.check()
    except ValueError as e:
        p.error(str(e))
    result = alternate(cfg, args.layouts, args.pairs)
    command = ("python -m megatron_csbp.bench.alternate " + shlex.join(argv)).strip()
    md = render(result, command)
    print(md)
    write_file(args.json, dict(result, command=command))
    write_file(args.markdown, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
