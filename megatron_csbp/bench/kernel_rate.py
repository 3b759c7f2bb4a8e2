"""Kernel rate on CPU: one rank's whole block-diffusion mask (the 2L rows [noisy ; clean] against
themselves) forward + backward, per allowed pair and head, against torch's SDPA (its CPU flash
kernel) on a causal mask over the same 2L rows, measured side by side in one run.

`python -m megatron_csbp.bench.kernel_rate [--seq-lengths 2048 4096] [--kernels tiled cpu_flash]`

Times are thread CPU time (one thread, `torch.set_num_threads(1)`), best of `--repeats`, so other
jobs on a shared machine inflate them less than wall time; kernels and SDPA alternate within a
repeat so drifts hit both. `rate_vs_sdpa` = SDPA's ns per pair / the kernel's (1 = SDPA's rate).
"""
from __future__ import annotations

import os
import shlex
import sys
import time
import timeit
from functools import partial
from typing import Dict, List, Sequence

import torch


def best_cpu_s(fn, repeats: int) -> float:
    """The least main-thread CPU seconds of `repeats` calls of `fn()` (garbage collection on, as
    outside `timeit`)."""
    return min(timeit.repeat(fn, "gc.enable()", time.thread_time, repeat=repeats, number=1))


def kernel_rates(seq_lengths: Sequence[int] = (2048, 4096), kernels: Sequence[str] = ("tiled", "cpu_flash"),
                 block_size: int = 64, heads: int = 4, groups: int = 2, head_dim: int = 64, repeats: int = 3,
                 dtype: torch.dtype = torch.float32) -> List[Dict]:
    from megatron_csbp.attention.kernels.registry import get_kernel
    from megatron_csbp.layout.masks import BlockGeometry, logical_rows
    from megatron_csbp.layout.rows import PartialMask

    torch.set_num_threads(1)
    rows = []
    for L in seq_lengths:
        meta = logical_rows(L)
        mask = PartialMask.of(meta, meta, BlockGeometry(L, block_size))
        pairs = mask.allowed_pairs()
        gen = torch.Generator().manual_seed(L)
        n = 2 * L
        q, k, v = (torch.randn(n, 1, h, head_dim, generator=gen).to(dtype).requires_grad_()
                   for h in (heads, groups, groups))
        scale = head_dim ** -0.5
        qs, ks, vs = (x.detach().permute(1, 2, 0, 3).contiguous().requires_grad_() for x in (q, k, v))

        def sdpa():
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            o.sum().backward()

        def run(kernel):
            o, lse = kernel(q, k, v, mask, scale)
            (o.sum() + lse.sum() * 1e-3).backward()  # the lse gets a gradient, as in a merge

        fns = {name: partial(run, get_kernel(name, q.device)) for name in kernels}
        for f in fns.values():  # plans and tables built, caches warm
            f()
        samples = [[best_cpu_s(f, 1) for f in (sdpa, *fns.values())] for _ in range(repeats)]  # SDPA, kernels
        t_sdpa, *kernel_s = (min(column) for column in zip(*samples))
        sdpa_ns = t_sdpa / (n * (n + 1) // 2 * heads) * 1e9  # SDPA's causal mask over 2L rows
        for name in kernels:
            t = dict(zip(fns, kernel_s))[name]
            ns = t / (pairs * heads) * 1e9
            rows.append({"kernel": name, "seq_length": L, "block_size": block_size, "heads": heads, "groups": groups,
                         "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""), "allowed_pairs": pairs,
                         "kernel_s": t, "ns_per_pair_head": ns, "sdpa_s": t_sdpa,
                         "sdpa_ns_per_pair_head": sdpa_ns, "rate_vs_sdpa": sdpa_ns / ns})
    return rows


def render(rows: List[Dict]) -> str:
    lines = ["| kernel | L | allowed pairs (M) | fwd+bwd (s) | ns / pair / head | SDPA causal 2L (ns / pair / head) "
             "| rate vs SDPA |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['seq_length']} | {r['allowed_pairs'] / 1e6:.1f} | {r['kernel_s']:.3f} "
              f"| {r['ns_per_pair_head']:.1f} | {r['sdpa_ns_per_pair_head']:.1f} | {r['rate_vs_sdpa']:.2f} |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None):
    from megatron_csbp.bench.report import bench_parser, write_file

    p = bench_parser("kernel_rate", __doc__, raw=True)
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--kernels", nargs="+", default=["tiled", "cpu_flash"])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--markdown", metavar="FILE", help="also write a report: the command, the conditions, the table")
    a = p.parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = kernel_rates(a.seq_lengths, a.kernels, a.block_size, repeats=a.repeats)
    table = render(rows)
    print(table)
    write_file(a.json, rows)
    if a.markdown:
        command = "python -m megatron_csbp.bench.kernel_rate " + shlex.join(argv or sys.argv[1:])
        write_file(a.markdown, "# CPU kernel rate against SDPA\n\nMade by:\n\n```\n" + command + "\n```\n\n"
                   "One thread, fp32, H = 4 query heads, G = 2 K/V groups, d = 64, micro-batch 1; the mask: one "
                   "rank's whole BD3-LM mask (2L rows [noisy ; clean] against themselves, block-causal clean "
                   f"stream, block {a.block_size}); forward + backward (loss sum(out) + 1e-3 sum(lse), so the lse "
                   "gradient path runs) per allowed pair and query head. SDPA: torch's scaled_dot_product_attention "
                   "(its CPU flash kernel) on a causal mask over the same 2L rows (2L(2L+1)/2 pairs), in the same "
                   f"run, alternating with the kernels; best of {a.repeats} by thread CPU time. Machine: "
                   f"{os.cpu_count()} CPUs shared with other developers' jobs (load average {load:.1f} at the "
                   f"start); torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n"
                   + table + "\n")


if __name__ == "__main__":
    from megatron_csbp.utils.cli import run

    sys.exit(run(main))
