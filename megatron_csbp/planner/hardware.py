"""Hardware profiles: what one accelerator (or one CPU rank) can do.

Presets for H100 and H200 take the physical limits of the design brief (dense bf16 989 TFLOP/s,
NVLink 450 GB/s per direction, HBM 3.35 / 4.8 TB/s, 80 / 141 GB) and efficiency factors that are
assumptions, stated here and in docs/planner.md. A measured profile of the current machine
(`python -m megatron_csbp.plan --profile FILE`) replaces them with measured rates.
"""
from __future__ import annotations

import json
import os
import time
import timeit
from dataclasses import asdict, dataclass, fields, replace
from typing import Dict

GiB = 2 ** 30


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_tflops: float  # dense matrix rate of one device at `dtype_bytes` precision
    gemm_efficiency: float  # achieved fraction of peak on transformer GEMMs
    attention_efficiency: float  # achieved fraction of peak on the block-aware attention kernel
    grouped_gemm_efficiency: float  # MoE expert GEMMs (many small matrices)
    memory_gib: float  # device memory
    reserved_gib: float  # context, communicator buffers, allocator fragmentation
    hbm_gbps: float  # memory bandwidth (elementwise work, optimizer step)
    intra_node_gbps: float  # per direction, per device (NVLink)
    inter_node_gbps: float  # per direction, per device (InfiniBand / RoCE)
    collective_efficiency: float  # achieved fraction of link bandwidth in collectives
    collective_latency_us: float  # fixed cost of one collective
    dtype_bytes: int = 2  # activations / K/V element size
    # 'sparse': the kernel only computes the mask's allowed (query, key) pairs (FlexAttention's
    # block masks on GPU), masks kept as row vectors; 'tiled': the same work on the tiled kernel
    # (the CPU default), whose per-partial outputs and backward working set are counted too
    # (`cost.partials_in_flight_bytes`, `cost.attention_transient_bytes`); 'dense_partials': each
    # partial computes every pair of its query x key rectangle and masks afterwards (the CPU
    # math kernel, `--attention-kernel math`).
    attention_kernel: str = "sparse"
    grad_reduce_overlap: float = 0.8  # fraction of DP gradient traffic hidden behind backward
    elementwise_bytes_per_row_layer_per_hidden: float = 40.0  # norms, activations, residuals (fwd+bwd)
    notes: str = ""

    def to_dict(self) -> Dict:
        return asdict(self)

    def link_gbps(self, spans_nodes: bool) -> float:
        return (self.inter_node_gbps if spans_nodes else self.intra_node_gbps) * self.collective_efficiency


_GPU_ASSUMPTIONS = ("efficiencies are assumptions: GEMMs 55% of dense peak (Megatron/TE bf16 at large "
                    "shapes), block-sparse FlexAttention-class kernel 40%, MoE grouped GEMMs 30%, collectives "
                    "reach 75% of link bandwidth; 4 GiB reserved per GPU")

_H100 = HardwareProfile(
    name="h100", peak_tflops=989.0, gemm_efficiency=0.55, attention_efficiency=0.40,
    grouped_gemm_efficiency=0.30, memory_gib=80e9 / GiB, reserved_gib=4.0, hbm_gbps=3350.0,
    intra_node_gbps=450.0, inter_node_gbps=50.0, collective_efficiency=0.75, collective_latency_us=20.0,
    notes="H100 SXM: 989 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 450 GB/s per direction, "
          "400 Gb/s InfiniBand per GPU; " + _GPU_ASSUMPTIONS)
PRESETS: Dict[str, HardwareProfile] = {
    "h100": _H100,
    "h200": replace(_H100, name="h200", memory_gib=141e9 / GiB, hbm_gbps=4800.0,
                    notes="H200 SXM: 989 TFLOP/s bf16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 450 GB/s per "
                          "direction, 400 Gb/s InfiniBand per GPU; " + _GPU_ASSUMPTIONS),
}


def load_hardware(spec: str) -> HardwareProfile:
    """'h100', 'h200', 'measured' (profile this machine now) or a JSON FILE from `--profile`."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "measured":
        return measure_cpu_profile()
    if not os.path.exists(spec):
        raise ValueError(f"--hardware {spec!r}: not one of {sorted(PRESETS) + ['measured']} and no such file")
    with open(spec) as f:
        data = json.load(f)
    unknown = set(data) - {f.name for f in fields(HardwareProfile)}
    if unknown:
        raise ValueError(f"--hardware {spec}: unknown keys {sorted(unknown)}")
    try:
        return HardwareProfile(**data)
    except TypeError as e:
        raise ValueError(f"--hardware {spec}: {e}") from None


def save_hardware(profile: HardwareProfile, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(profile.to_dict(), f, indent=1)


# ---- measure a hardware profile of this machine for the CPU path (`--profile FILE`, `--hardware measured`).
#
# Each rank of the CPU benchmark is one thread, so the profile is of one thread:
# - matrix rate: fp32 GEMMs of the benchmark's shapes;
# - attention rate: the project's own math kernel (forward + backward) on a masked partial, expressed
#   as the fraction of the matrix rate it reaches per computed (query, key) pair (`dense_partials`);
# - memory bandwidth: a large copy;
# - link: gloo all-gather bandwidth and small all-reduce latency between two local processes.


def _best_time(fn, repeat: int = 5) -> float:
    fn()
    return min(timeit.repeat(fn, number=1, repeat=repeat))


def _mean_time(fn, reps: int, warmup: int = 0) -> float:
    """Seconds per call of `fn` over `reps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return timeit.timeit(fn, number=reps) / reps


def _gemm_gflops(n: int = 384) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / _best_time(lambda: a @ b) / 1e9


def _attention_gflops(sq: int = 512, sk: int = 512, heads: int = 4, groups: int = 2, d: int = 32) -> float:
    import torch

    from megatron_csbp.attention.kernels.registry import math_partial_attention
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
    import torch

    a = torch.empty(n // 4)
    b = torch.empty_like(a)
    return 2 * n / _best_time(lambda: b.copy_(a)) / 1e9


def _link_worker(rank, world, out):
    import torch
    import torch.distributed as dist

    x = torch.randn(2 ** 20)  # 4 MiB per rank
    buf = torch.empty(world * x.numel())
    gather_s = _mean_time(lambda: dist.all_gather_into_tensor(buf, x), 5, warmup=2)
    small = torch.zeros(1)
    return {"gbps": x.numel() * 4 * (world - 1) / gather_s / 1e9,
            "latency_us": _mean_time(lambda: dist.all_reduce(small), 20, warmup=3) * 1e6}


def measure_cpu_profile(name: str = "measured-cpu") -> HardwareProfile:
    import torch

    from megatron_csbp.parallel.spawn import spawn

    torch.set_num_threads(1)
    gemm, attn, mem = _gemm_gflops(), _attention_gflops(), _memory_gbps()
    link = spawn(_link_worker, 2, None)[0]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB  # physical memory
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
