"""Measure a hardware profile of this machine for the CPU path (`--profile FILE`, `--hardware measured`).

Each rank of the CPU benchmark is one thread, so the profile is of one thread:
- matrix rate: fp32 GEMMs of the benchmark's shapes;
- attention rate: the project's own math kernel (forward + backward) on a masked partial, expressed
  as the fraction of the matrix rate it reaches per computed (query, key) pair (`dense_partials`);
- memory bandwidth: a large copy;
- link: gloo all-gather bandwidth and small all-reduce latency between two local processes.
"""
from __future__ import annotations

import os
import time

import torch

from megatron_csbp.planner.hardware import GiB, HardwareProfile


def _best_time(fn, repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _gemm_gflops(n: int = 384) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / _best_time(lambda: a @ b) / 1e9


def _attention_gflops(sq: int = 512, sk: int = 512, heads: int = 4, groups: int = 2, d: int = 32) -> float:
    from megatron_csbp.attention.kernels import math_partial_attention
    from megatron_csbp.layout.masks import BlockGeometry, RowMeta
    from megatron_csbp.layout.rows import PartialMask

    q = torch.randn(sq, 1, heads, d, requires_grad=True)
    k = torch.randn(sk, 1, groups, d, requires_grad=True)
    v = torch.randn(sk, 1, groups, d, requires_grad=True)
    # Clean token-causal rows: about half the pairs allowed (the math kernel computes them all).
    none = torch.zeros(0, dtype=torch.long)
    mask = PartialMask.of(RowMeta.of(none, torch.arange(sq)), RowMeta.of(none, torch.arange(sk)),
                          BlockGeometry(max(sq, sk), 1, "token_causal"))

    def run():
        out, lse = math_partial_attention(q, k, v, mask, d ** -0.5)
        (out.sum() + lse.sum()).backward()

    flops = sq * sk * 4 * heads * d * 3.5  # the cost model's forward + backward count
    return flops / _best_time(run, 3) / 1e9


def _memory_gbps(n: int = 32 * 2 ** 20) -> float:
    a = torch.empty(n // 4)
    b = torch.empty_like(a)
    return 2 * n / _best_time(lambda: b.copy_(a)) / 1e9


def _link_worker(rank, world, out):
    import torch.distributed as dist

    sizes = {}
    x = torch.randn(2 ** 20)  # 4 MiB per rank
    buf = torch.empty(world * x.numel())
    for _ in range(2):
        dist.all_gather_into_tensor(buf, x)
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        dist.all_gather_into_tensor(buf, x)
    bw = reps * x.numel() * 4 * (world - 1) / (time.perf_counter() - t0) / 1e9
    small = torch.zeros(1)
    for _ in range(3):
        dist.all_reduce(small)
    t0 = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(small)
    sizes["gbps"], sizes["latency_us"] = bw, (time.perf_counter() - t0) / 20 * 1e6
    return sizes


def measure_cpu_profile(name: str = "measured-cpu") -> HardwareProfile:
    torch.set_num_threads(1)
    gemm = _gemm_gflops()
    attn = _attention_gflops()
    mem = _memory_gbps()
    from megatron_csbp.utils.spawn import spawn

    link = spawn(_link_worker, 2, None)[0]
    try:
        import psutil
        total = psutil.virtual_memory().total / GiB
    except Exception:
        total = 8.0
    return HardwareProfile(
        name=name, peak_tflops=gemm / 1e3, gemm_efficiency=1.0, attention_efficiency=min(1.0, attn / gemm),
        grouped_gemm_efficiency=1.0, memory_gib=total, reserved_gib=0.0, hbm_gbps=mem,
        intra_node_gbps=link["gbps"], inter_node_gbps=link["gbps"], collective_efficiency=1.0,
        collective_latency_us=link["latency_us"], dtype_bytes=4, attention_kernel="dense_partials",
        grad_reduce_overlap=0.0,
        notes=(f"measured on {os.cpu_count()} CPUs, one thread per rank, {time.strftime('%Y-%m-%d %H:%M')} "
               f"(load average {os.getloadavg()[0]:.1f}); fp32 GEMM {gemm:.1f} GFLOP/s, math attention kernel "
               f"{attn:.1f} GFLOP/s per computed pair, copy {mem:.1f} GB/s, gloo all-gather {link['gbps']:.2f} GB/s, "
               f"all-reduce latency {link['latency_us']:.0f} us"),
    )
