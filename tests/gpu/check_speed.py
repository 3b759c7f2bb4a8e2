"""Block-diffusion attention's time, TFLOP/s and peak memory against dense causal SDPA, one GPU.

For T tokens (default 8K, 32K, 128K) one sequence on one rank: `block_diffusion_attention` (the
entry point the core attention calls; plan of `SequenceLayout(BlockGeometry(T, B, block_causal))`,
2T rows [noisy ; clean], the default CUDA kernel Flex, or `--kernel`) forward and forward + backward
in bf16, against torch's SDPA, flash backend, causal over the same T tokens (what an autoregressive
model of that length pays), K/V repeated to H heads. FLOPs are counted on the allowed pairs (the
block-diffusion mask's `allowed_pairs()`; T(T+1)/2 for causal), 4 H d a pair forward, 2.5x that
backward. Time: median of `--reps` CUDA-event timings after one warm call (forward timed on inputs
that require gradients, as in training; the graph it builds is dropped); memory:
`torch.cuda.max_memory_allocated` over one forward + backward, from a reset, inputs included.

    python tests/gpu/check_speed.py --out speed.json                         (CUDA)
    python tests/gpu/check_speed.py --device cpu --tokens 128 --out s.json   (the dry run: CPU times)

Every length must run (an error or a timeout is a failure: exit 1); there is no speed threshold:
the numbers are measurements to read, with the device and versions beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_csbp.attention.block_attention import block_diffusion_attention, plan_for_layout  # noqa: E402
from megatron_csbp.attention.kernels.registry import get_kernel  # noqa: E402
from megatron_csbp.layout.layout import SequenceLayout  # noqa: E402
from megatron_csbp.layout.masks import BlockGeometry  # noqa: E402
from check_kernels import timed  # noqa: E402  (tests/gpu/ is the script's own folder)


def peak_bytes(fn, dev: torch.device):
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(dev)


def measure(T: int, B: int, H: int, G: int, d: int, kernel_name: str, reps: int, dev: torch.device) -> dict:
    from check_kernels import block_diffusion_mask

    pairs = int(block_diffusion_mask(2 * T, B, "block_causal").allowed_pairs())
    causal_pairs = T * (T + 1) // 2
    gen = torch.Generator(device="cpu").manual_seed(T)
    make = lambda n, h: torch.randn(n, 1, h, d, generator=gen).to(dev, torch.bfloat16)  # noqa: E731
    q, k, v, g = make(2 * T, H), make(2 * T, G), make(2 * T, G), make(2 * T, H)
    plan = plan_for_layout(SequenceLayout(BlockGeometry(T, B, "block_causal"), 1, 1))
    kernel = get_kernel(kernel_name, dev)
    scale = d ** -0.5
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    # the forward is timed with the same inputs as the forward + backward (requires_grad): compiled
    # Flex then runs the one compiled graph for both, instead of compiling a no-grad variant too
    def bd_fwd():
        block_diffusion_attention(qg, kg, vg, plan, softmax_scale=scale, kernel=kernel)

    def bd_fwd_bwd():
        block_diffusion_attention(qg, kg, vg, plan, softmax_scale=scale, kernel=kernel).backward(g)

    F = torch.nn.functional
    # the autoregressive baseline: T tokens (the clean half), K/V repeated to H heads
    qt, kt, vt = (x[T:].repeat_interleave(H // x.shape[2], 2).permute(1, 2, 0, 3).contiguous().requires_grad_()
                  for x in (q, k, v))
    gt = g[T:].permute(1, 2, 0, 3).contiguous()
    backends = [torch.nn.attention.SDPBackend.FLASH_ATTENTION] if dev.type == "cuda" else \
        [torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.MATH]

    def sdpa_fwd():
        with torch.nn.attention.sdpa_kernel(backends):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)

    def sdpa_fwd_bwd():
        with torch.nn.attention.sdpa_kernel(backends):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale).backward(gt)

    out = {"tokens": T, "rows": 2 * T, "block_size": B, "heads": H, "groups": G, "head_dim": d,
           "kernel": kernel_name, "allowed_pairs": pairs, "causal_pairs": causal_pairs}
    flops = lambda n: 4.0 * H * d * n  # noqa: E731
    for name, fwd, fwd_bwd, n in (("block_diffusion", bd_fwd, bd_fwd_bwd, pairs),
                                  ("sdpa_causal", sdpa_fwd, sdpa_fwd_bwd, causal_pairs)):
        t_f, t_fb = timed(fwd, reps, dev), timed(fwd_bwd, reps, dev)
        out[name] = {"fwd_ms": t_f * 1e3, "fwd_bwd_ms": t_fb * 1e3, "fwd_tflops": flops(n) / t_f / 1e12,
                     "fwd_bwd_tflops": 3.5 * flops(n) / t_fb / 1e12, "peak_bytes": peak_bytes(fwd_bwd, dev)}
    out["time_ratio_fwd_bwd"] = out["block_diffusion"]["fwd_bwd_ms"] / out["sdpa_causal"]["fwd_bwd_ms"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kernel", default="auto", help="--attention-kernel: auto is Flex on CUDA, cpu_flash on CPU")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("check_speed: --device cuda but no CUDA device (use --device cpu for the dry run)", file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "cases": [], "failed": []}
    t0 = time.time()
    for T in a.tokens:
        try:
            case = measure(T, a.block_size, a.heads, a.groups, a.head_dim, a.kernel, a.reps, dev)
        except Exception as exc:  # one length failing is a failure, and the others still run
            case = {"tokens": T, "error": f"{type(exc).__name__}: {exc}"[:500]}
            report["failed"].append(f"T={T}: {case['error']}")
        report["cases"].append(case)
        print(json.dumps(case), flush=True)
        report["ok"], report["wall_s"] = False, time.time() - t0  # not ok until every length ran
        with open(a.out, "w") as f:  # after every length: a timeout keeps what finished
            json.dump(report, f, indent=1)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report["ok"] = not report["failed"]
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    for line in report["failed"]:
        print(f"FAILED {line}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
