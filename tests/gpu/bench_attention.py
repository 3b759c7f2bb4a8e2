"""Single-GPU benchmark of the block-aware attention vs dense causal flash attention.

For each L: the block-diffusion attention of one rank holding all 2L rows (FlexAttention with the
block mask of the real [noisy ; clean] mask, partials merged with log-sum-exp), once with the
project's kernel as it is (eager `flex_attention`) and once with `flex_attention` compiled, against
`scaled_dot_product_attention(is_causal=True)` (flash backend) over the same 2L rows. TFLOP/s are
counted on the work each call really has to do: allowed pairs of the block-diffusion mask
(L*(L+B)) and (2L)^2/2 for causal; forward 4*H*d flops per pair, backward 2.5x forward.

  python tests/gpu/bench_attention.py --out report.json [--lengths 4096 8192 16384]
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from megatron_csbp.attention.block_attention import block_diffusion_attention, plan_for_layout
from megatron_csbp.attention.kernels import get_kernel
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry


_COMPILED = {}


def compiled_flex_kernel(q, k, v, allowed, softmax_scale):
    """The project's flex kernel (megatron_csbp.attention.kernels.flex_partial_attention) with
    `flex_attention` and `create_block_mask` compiled: eager flex materializes the score matrix."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    sq, b, H, d = q.shape
    sk, G = k.shape[0], k.shape[2]
    allowed = allowed.to(q.device)

    def mask_mod(batch, head, qi, ki):
        return allowed[qi, ki]

    block_mask = create_block_mask(mask_mod, None, None, sq, sk, device=q.device, _compile=True)
    qt, kt, vt = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    out, lse = _COMPILED["flex"](qt, kt, vt, block_mask=block_mask, scale=softmax_scale, enable_gqa=G != H,
                                 return_lse=True)
    lse = lse.float().clamp_min(-1.0e30)
    return out.permute(2, 0, 1, 3), lse


def timed(fn, warmup=2, reps=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default="attention_bench.json")
    a = p.parse_args()
    dev = torch.device("cuda")
    H, G, d, B = a.heads, a.groups, a.head_dim, a.block_size
    rows = []
    for L in a.lengths:
        geometry = BlockGeometry(L, B)
        plan = plan_for_layout(SequenceLayout(geometry, 1, 1))
        q = torch.randn(2 * L, 1, H, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2 * L, 1, G, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2 * L, 1, G, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn_like(q)
        def bd(kernel, backward):
            def run():
                if backward:
                    block_diffusion_attention(q, k, v, plan, softmax_scale=d ** -0.5, kernel=kernel).backward(g)
                else:
                    with torch.no_grad():
                        block_diffusion_attention(q, k, v, plan, softmax_scale=d ** -0.5, kernel=kernel)
            return run

        project = get_kernel("flex", dev)

        qt, kt, vt = (x.detach().permute(1, 2, 0, 3).contiguous().requires_grad_() for x in (q, k, v))
        gt = g.permute(1, 2, 0, 3).contiguous()

        def sdpa_fwd():
            with torch.no_grad(), torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

        def sdpa_fwd_bwd():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).backward(gt)

        pairs_bd = L * (L + B)
        pairs_causal = (2 * L) * (2 * L + 1) // 2
        f = 4 * H * d
        row = {"L": L, "B": B, "H": H, "G": G, "d": d, "pairs_block_diffusion": pairs_bd, "pairs_causal_2L": pairs_causal}
        for name, fn, pairs, mult in (("block_diffusion_fwd", bd(project, False), pairs_bd, 1.0),
                                      ("block_diffusion_fwd_bwd", bd(project, True), pairs_bd, 3.5),
                                      ("block_diffusion_compiled_fwd", bd(compiled_flex_kernel, False), pairs_bd, 1.0),
                                      ("block_diffusion_compiled_fwd_bwd", bd(compiled_flex_kernel, True), pairs_bd, 3.5),
                                      ("causal_flash_fwd", sdpa_fwd, pairs_causal, 1.0),
                                      ("causal_flash_fwd_bwd", sdpa_fwd_bwd, pairs_causal, 3.5)):
            try:
                t = timed(fn)
                row[name] = {"ms": t * 1e3, "tflops": pairs * f * mult / t / 1e12}
            except Exception as e:  # report, keep going
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(a.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
