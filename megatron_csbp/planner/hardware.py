"""Hardware profiles: what one accelerator (or one CPU rank) can do.

Presets for H100 and H200 take the physical limits of the design brief (dense bf16 989 TFLOP/s,
NVLink 450 GB/s per direction, HBM 3.35 / 4.8 TB/s, 80 / 141 GB) and efficiency factors that are
assumptions, stated here and in docs/planner.md. A measured profile of the current machine
(`python -m megatron_csbp.plan --profile FILE`) replaces them with measured rates.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Dict

GB = 1e9
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

PRESETS: Dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100", peak_tflops=989.0, gemm_efficiency=0.55, attention_efficiency=0.40,
        grouped_gemm_efficiency=0.30, memory_gib=80e9 / GiB, reserved_gib=4.0, hbm_gbps=3350.0,
        intra_node_gbps=450.0, inter_node_gbps=50.0, collective_efficiency=0.75, collective_latency_us=20.0,
        notes="H100 SXM: 989 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 450 GB/s per direction, "
              "400 Gb/s InfiniBand per GPU; " + _GPU_ASSUMPTIONS),
    "h200": HardwareProfile(
        name="h200", peak_tflops=989.0, gemm_efficiency=0.55, attention_efficiency=0.40,
        grouped_gemm_efficiency=0.30, memory_gib=141e9 / GiB, reserved_gib=4.0, hbm_gbps=4800.0,
        intra_node_gbps=450.0, inter_node_gbps=50.0, collective_efficiency=0.75, collective_latency_us=20.0,
        notes="H200 SXM: 989 TFLOP/s bf16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 450 GB/s per direction, "
              "400 Gb/s InfiniBand per GPU; " + _GPU_ASSUMPTIONS),
}


def load_hardware(spec: str) -> HardwareProfile:
    """'h100', 'h200', 'measured' (profile this machine now) or a JSON FILE from `--profile`."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "measured":
        from megatron_csbp.planner.profile import measure_cpu_profile

        return measure_cpu_profile()
    if not os.path.exists(spec):
        raise ValueError(f"--hardware {spec!r}: not one of {sorted(PRESETS) + ['measured']} and no such file")
    with open(spec) as f:
        data = json.load(f)
    known = {f.name for f in fields(HardwareProfile)}
    unknown = set(data) - known
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
