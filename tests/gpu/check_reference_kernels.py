"""The GPU measurement behind the planner's fitted reference-baseline rates (planner/reference.py,
docs/planner.md "The paper explained"): on one rank's whole block-diffusion mask (L/2 noisy + L/2
clean rows against all L keys, `check_kernels.block_diffusion_mask`), in bf16,

- the compiled FlexAttention kernel (`get_kernel("flex")`: one Flex call over all keys, as the
  paper's CP path runs its forward) forward and forward + backward;
- the flash-attn decomposition (`get_kernel("flash")`: full pieces through flash-attn, partial
  tiles through the tiled kernel, merged by lse; the FA-class kernel CSBP gets);

at head dim 128 and 256. It writes the measured Flex / flash forward-rate ratio beside the fitted
constants `FLEX_FORWARD_RATE_128` (0.68) and `FLEX_RATE_256` (1.0): a measured ratio far from
them says the planner's `--baseline reference` explains the paper with the wrong kernel rates.
(The paper's FA4 kernels are Blackwell/Hopper CuTe kernels this project does not ship; flash-attn
on the H200 is the nearest stand-in, so the ratio is a lower bound on FA4's advantage.)

  python tests/gpu/check_reference_kernels.py --out reference_kernels.json   (CUDA)

Without CUDA it writes {"skipped": "..."} and exits 0: the rates are GPU kernel rates, and a CPU
run would measure nothing the constants describe.
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

from megatron_csbp.attention.kernels.registry import get_kernel  # noqa: E402
from megatron_csbp.planner.reference import FLEX_FORWARD_RATE_128, FLEX_RATE_256  # noqa: E402

NO_CUDA = "no CUDA device: the fitted constants are GPU kernel rates (Flex vs flash-attn); nothing to measure on CPU"


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(L: int, B: int, heads: int, groups: int, head_dim: int, reps: int) -> dict:
    from check_kernels import block_diffusion_mask

    dev = torch.device("cuda")
    mask = block_diffusion_mask(L, B, "block_causal")
    pairs = int(mask.allowed_pairs())
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(L, 1, heads, head_dim, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(L, 1, groups, head_dim, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(L, 1, groups, head_dim, device=dev, dtype=torch.bfloat16, generator=g)
    scale = head_dim ** -0.5
    out = {"L_rows": L, "block_size": B, "heads": heads, "groups": groups, "head_dim": head_dim,
           "allowed_pairs": pairs}
    for name in ("flex", "flash"):
        try:
            kernel = get_kernel(name, dev)
        except Exception as e:  # flash-attn not installed: say so, keep the other kernel
            out[name] = {"missing": str(e)}
            continue
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                kernel(q, k, v, mask, scale)

        def fwd_bwd():
            o, lse = kernel(qq, kk, vv, mask, scale)
            (o.float().sum() + lse.float().sum()).backward()

        t_f, t_fb = timed(fwd, reps), timed(fwd_bwd, reps)
        flops = 4 * heads * head_dim * pairs
        out[name] = {"fwd_s": t_f, "fwd_bwd_s": t_fb, "fwd_tflops": flops / t_f / 1e12,
                     "bwd_tflops": 2.5 * flops / max(1e-12, t_fb - t_f) / 1e12}
    if "fwd_s" in out.get("flex", {}) and "fwd_s" in out.get("flash", {}):
        out["flex_over_flash_fwd_rate"] = out["flash"]["fwd_s"] / out["flex"]["fwd_s"]
        out["flex_over_flash_bwd_rate"] = ((out["flash"]["fwd_bwd_s"] - out["flash"]["fwd_s"])
                                           / (out["flex"]["fwd_bwd_s"] - out["flex"]["fwd_s"]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="reference_kernels.json")
    p.add_argument("--rows", type=int, default=32768, help="L rows (L/2 tokens, noisy + clean)")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    report = {"fitted": {"FLEX_FORWARD_RATE_128": FLEX_FORWARD_RATE_128, "FLEX_RATE_256": FLEX_RATE_256}}
    if not torch.cuda.is_available():
        report["skipped"] = NO_CUDA
        print(f"check_reference_kernels: skipped: {NO_CUDA}")
    else:
        # the head shapes of the paper's models: Nemotron 32 / 8 x 128, Qwen3.5 full layers 24 / 4 x 256
        report["cases"] = [measure(args.rows, args.block_size, 32, 8, 128, args.reps),
                           measure(args.rows, args.block_size, 24, 4, 256, args.reps)]
        for c in report["cases"]:
            print(json.dumps(c))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
