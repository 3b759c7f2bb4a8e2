"""Partial-attention kernels against dense fp64 attention, then their speed, as one JSON file.

For each L (rows of the partial): one rank holding a whole sequence of L/2 tokens, its L rows
[noisy ; clean] attending all L rows under the block-diffusion mask (`PartialMask`: both the
noisy block-diagonal and the clean layer), q [L, 1, H, d], k/v [L, 1, G, d] in bf16. Each kernel
(`get_kernel(name)`: tiled, flex, flash; math on small L) runs forward and backward with the loss
<out, dO> + <lse, dlse> (the lse gradient is what log-sum-exp merges use), against dense attention
computed in float64 from the same bf16 inputs, in query chunks (`reference`).

Tolerances, error model: inputs are the same bf16 tensors, so the error is the kernel's own
rounding: outputs and P / dS tiles rounded to bf16 (unit roundoff u = 2^-8), fp32 accumulation.
Independent roundings add in quadrature, so the relative Frobenius error of out is ~u/2 and of
dq/dk/dv (two more rounded products) ~u; we allow 4u = 1.6e-2 for out and 8u = 3.1e-2 for the
gradients; the lse (fp32 from fp32 sums of bf16 products; |scores| <~ 10 -> error <~ 10 u^2... plus
the score rounding of flash-style kernels, ~u relative on |score|) is checked in absolute terms
with 2e-2. A kernel that drops or adds one block of keys is off by O(1) in all of these.

Then a 512-wide layer (DiffusionGemma's global head dim): the kernel `--attention-kernel auto` takes
for it on this device (the capability table, `attention/kernels/capability.py`), forward and backward
against fp64 at --wide-rows rows, same tolerances.

Speed: forward and forward+backward time (median of reps), TFLOP/s counted on the mask's allowed
pairs (`PartialMask.allowed_pairs()`, 4*H*d flops a pair forward, 2.5x that backward) against
torch SDPA (flash backend) causal over L rows at the same H/G/d (L(L+1)/2 pairs).

  python tests/gpu/check_kernels.py --out gpu_kernels.json                  (CUDA)
  python tests/gpu/check_kernels.py --device cpu --lengths 256 --no-timing  (the CI dry run)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megatron_csbp.attention.kernels.registry import MASKED_SCORE, get_kernel  # noqa: E402
from megatron_csbp.layout.masks import BlockGeometry, RowMeta  # noqa: E402
from megatron_csbp.layout.rows import PartialMask  # noqa: E402

TOL = {"out_rel": 1.6e-2, "grad_rel": 3.1e-2, "lse_abs": 2e-2}


def block_diffusion_mask(L: int, B: int, clean_attention: str) -> PartialMask:
    """L rows: L/2 noisy then L/2 clean tokens of one sequence, against all of them."""
    S = L // 2
    rows = RowMeta.of(torch.arange(S), torch.arange(S))
    return PartialMask.of(rows, rows, BlockGeometry(S, B, clean_attention))


def reference(q, k, v, mask: PartialMask, scale, d_out, d_lse, chunk=1024):
    """Dense attention in float64 by query chunks: out, lse, and dq/dk/dv of
    <out, d_out> + <lse, d_lse>. Rows with no key: out 0, lse MASKED_SCORE, no gradient."""
    sq, b, H, dh = q.shape
    sk, G = k.shape[0], k.shape[2]
    assert b == 1
    rep = H // G
    K = k[:, 0].double().repeat_interleave(rep, 1).transpose(0, 1)  # [H, sk, d]
    V = v[:, 0].double().repeat_interleave(rep, 1).transpose(0, 1)
    out = torch.zeros(sq, H, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((H, sq), MASKED_SCORE, dtype=torch.float64, device=q.device)
    dq = torch.zeros(sq, H, dh, dtype=torch.float64, device=q.device)
    dK = torch.zeros_like(K)
    dV = torch.zeros_like(V)
    dev_mask = mask.to(q.device)
    for a in range(0, sq, chunk):
        r = torch.arange(a, min(sq, a + chunk), device=q.device)
        allowed = dev_mask.block(r, slice(None))  # [c, sk] bool (this chunk only)
        has = allowed.any(1)
        Q = q[r, 0].double().transpose(0, 1)  # [H, c, d]
        s = (Q @ K.transpose(1, 2)) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        l = torch.logsumexp(s, -1)
        p = torch.nan_to_num(torch.exp(s - l[..., None]), nan=0.0)
        del s
        o = p @ V  # [H, c, d]
        dO = d_out[r, 0].double().transpose(0, 1)
        dl = d_lse[0][:, r].double() * has
        dp = dO @ V.transpose(1, 2)
        D = (dO * o).sum(-1)
        ds = p * (dp - D[..., None] + dl[..., None])
        del dp
        dq[r] = ((ds @ K) * scale).transpose(0, 1)
        dK += (ds.transpose(1, 2) @ Q) * scale
        dV += p.transpose(1, 2) @ dO
        out[r] = o.transpose(0, 1)
        lse[:, r] = torch.where(has, l, torch.full_like(l, MASKED_SCORE))
    fold = lambda x: x.view(G, rep, sk, -1).sum(1).transpose(0, 1)[:, None]  # noqa: E731  [sk, 1, G, d]
    return out[:, None], lse[None], dq[:, None], fold(dK), fold(dV)


def rel(a, b):
    return float((a.detach().double() - b).norm() / b.norm().clamp_min(1e-30))


def _call(kernel, name, q, k, v, mask, scale):
    """Kernels take the PartialMask. (Bridge while the math kernel still takes a dense mask on
    some branches: retry it with mask.dense(), for the small-L math reference only.)"""
    try:
        return kernel(q, k, v, mask, scale)
    except (AttributeError, TypeError):
        if name != "math":
            raise
        return kernel(q, k, v, mask.dense().to(q.device), scale)


#: kernels that exist only on CUDA: on another device they are "not_applicable" (stated, not run,
#: neither a pass nor a failure); on CUDA every requested kernel must import and run
CUDA_ONLY = {"flash": "flash-attn runs on CUDA only"}
#: kernels that need an optional package: where it is not installed they are "not_installed" (stated,
#: not run, never a pass); where it is installed and fails to import or run, a failure
NEEDS_PACKAGE = {"flash": ("flash_attn", "flash-attn")}


def not_installed(name):
    """The reason `name` cannot run here for want of its package, or None."""
    import importlib.util

    if name not in NEEDS_PACKAGE:
        return None
    module, dist = NEEDS_PACKAGE[name]
    return None if importlib.util.find_spec(module) is not None else f"{dist} is not installed"


def check_kernel(name, q, k, v, mask, scale, d_out, d_lse, ref, backward: bool):
    """One kernel's forward (and backward) against the fp64 reference. A kernel that cannot be
    selected (unknown name, its package missing or broken) or that raises is a failure: the caller
    records {"error": ...} and the report is not ok."""
    cell = {}
    kernel = get_kernel(name, q.device)
    qg, kg, vg = (x.detach().clone().requires_grad_(backward) for x in (q, k, v))
    t0 = time.perf_counter()
    out, lse = _call(kernel, name, qg, kg, vg, mask, scale)
    has = ref[1][0].amax(0) > MASKED_SCORE / 2  # rows with a key
    cell["fwd"] = {"out_rel": rel(out, ref[0]), "lse_abs": float((lse[..., has].double() - ref[1][..., has]).abs().max()),
                   "empty_rows_ok": bool((lse[..., ~has] == MASKED_SCORE).all() and not out[~has].any())}
    cell["fwd"]["ok"] = (cell["fwd"]["out_rel"] <= TOL["out_rel"] and cell["fwd"]["lse_abs"] <= TOL["lse_abs"]
                         and cell["fwd"]["empty_rows_ok"])
    if backward:
        ((out.double() * d_out.double()).sum() + (lse.double() * (d_lse * has).double()).sum()).backward()
        cell["bwd"] = {n: rel(g, r) for n, g, r in (("dq", qg.grad, ref[2]), ("dk", kg.grad, ref[3]), ("dv", vg.grad, ref[4]))}
        cell["bwd"]["ok"] = all(cell["bwd"][n] <= TOL["grad_rel"] for n in ("dq", "dk", "dv"))
    else:
        cell["bwd"] = {"skipped": "no backward on this device (FlexAttention has none on CPU)"}
    if q.is_cuda:
        torch.cuda.synchronize()
    cell["first_call_s"] = time.perf_counter() - t0  # includes compilation
    return cell


def timed(fn, reps: int, dev: torch.device = torch.device("cuda")) -> float:
    """Median seconds of `reps` calls after one warm call (CUDA events on CUDA, the host clock on CPU)."""
    fn()
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def speed(fn_fwd, fn_bwd, pairs, H, d, reps):
    f = 4.0 * H * d * pairs
    t_f, t_b = timed(fn_fwd, reps), timed(fn_bwd, reps)
    return {"fwd_ms": t_f * 1e3, "fwd_tflops": f / t_f / 1e12, "fwd_bwd_ms": t_b * 1e3, "fwd_bwd_tflops": 3.5 * f / t_b / 1e12}


def inputs(L, H, G, d, dev, dtype):
    """q, k, v, d_out [L, 1, heads, d] in `dtype` and d_lse [1, H, L] fp32, drawn on the CPU from seed L."""
    gen = torch.Generator(device="cpu").manual_seed(L)
    draw = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v, d_out = draw(L, 1, H, d), draw(L, 1, G, d), draw(L, 1, G, d), draw(L, 1, H, d)
    return q.to(dev, dtype), k.to(dev, dtype), v.to(dev, dtype), d_out.to(dev, dtype), draw(1, H, L).to(dev)


#: DiffusionGemma's global layers (global_head_dim 512; docs/diffusiongemma.md)
WIDE_HEAD_DIM = 512


def wide(a, dev, dtype, report, save):
    """A 512-wide layer: the kernel `--attention-kernel auto` takes for it on this device
    (`kernels.capability.choose`), forward and backward against fp64, at --wide-rows rows, 2 heads."""
    from megatron_csbp.attention.kernels.capability import choose

    L, H, G, d = a.wide_rows, 2, 1, WIDE_HEAD_DIM
    mask = block_diffusion_mask(L, a.block_size, a.clean_attention).to(dev)
    q, k, v, d_out, d_lse = inputs(L, H, G, d, dev, dtype)
    scale = 1.0 / math.sqrt(d)
    case = {"L": L, "head_dim": d, "heads": H, "groups": G, "allowed_pairs": mask.allowed_pairs(), "kernels": {}}
    report["cases"].append(case)
    try:
        case["auto_kernel"] = name = choose("auto", dev, d, dtype, backward=True)
        ref = reference(q, k, v, mask, scale, d_out, d_lse)
        cell = check_kernel(name, q, k, v, mask, scale, d_out, d_lse, ref, backward=True)
    except Exception as exc:  # a failure, recorded with the kernel that was chosen
        name = case.get("auto_kernel", "auto")
        cell = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-1500:]}
    case["kernels"][name] = cell
    print(json.dumps({"L": L, "head_dim": d, "kernel": name, **{k_: v_ for k_, v_ in cell.items() if k_ != "trace"}}),
          flush=True)
    save()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--kernels", nargs="+", default=["flex", "flash", "tiled"])
    p.add_argument("--math-max-rows", type=int, default=4096, help="also check the math kernel up to this L")
    p.add_argument("--tiled-max-rows", type=int, default=None, help="check the tiled kernel only up to this L")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--clean-attention", default="block_causal")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--wide-rows", type=int, default=1024,
                   help="rows of the 512-wide layer check (the kernel 'auto' takes there, fwd + bwd); 0: none")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--time-budget", type=float, default=300.0,
                   help="seconds for the whole check: timings that would not fit are skipped and reported")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_kernels.json"))
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    H, G, d = a.heads, a.groups, a.head_dim
    try:
        import flash_attn
        fa_version = flash_attn.__version__
    except ImportError:
        fa_version = None
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "flash_attn": fa_version, "config": {"H": H, "G": G, "d": d, "B": a.block_size, "dtype": a.dtype,
                                                   "clean_attention": a.clean_attention},
              "tolerances": TOL, "cases": []}
    start = time.time()

    def save():
        report["wall_s"] = time.time() - start
        # ok: every requested kernel that applies to the device was checked and passed. A kernel that
        # failed to import or run ("error") or was not reached in the time budget ("skipped") is not a
        # pass; only a CUDA-only kernel on another device ("not_applicable") is left out, by name.
        left_out = ("not_applicable", "not_installed")
        checked = [c for case in report["cases"] for c in case["kernels"].values() if not any(x in c for x in left_out)]
        report["failed"] = [f"L={case['L']}{' d=%d' % case['head_dim'] if 'head_dim' in case else ''} {name}: " + (c.get("error") or c.get("skipped") or "outside tolerance")
                            for case in report["cases"] for name, c in case["kernels"].items()
                            if not any(x in c for x in left_out) and not (
                                "fwd" in c and c["fwd"]["ok"] and c["bwd"].get("ok", True))]
        for x in left_out:
            report[x] = sorted({f"{name}: {c[x]}" for case in report["cases"]
                                for name, c in case["kernels"].items() if x in c})
        report["ok"] = bool(checked) and not report["failed"]
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(report, fh, indent=1)

    for L in a.lengths:
        mask = block_diffusion_mask(L, a.block_size, a.clean_attention).to(dev)  # the kernels' device, as the plan's
        pairs = mask.allowed_pairs()
        q, k, v, d_out, d_lse = inputs(L, H, G, d, dev, dtype)
        scale = 1.0 / math.sqrt(d)
        t0 = time.time()
        ref = reference(q, k, v, mask, scale, d_out, d_lse)
        case = {"L": L, "rows": L, "keys": L, "allowed_pairs": pairs, "rectangle": L * L,
                "reference_s": time.time() - t0, "kernels": {}}
        report["cases"].append(case)
        names = list(a.kernels) + (["math"] if L <= a.math_max_rows and "math" not in a.kernels else [])
        if a.tiled_max_rows is not None and L > a.tiled_max_rows:
            names = [n for n in names if n != "tiled"]
        for name in names:
            if dev.type != "cuda" and name in CUDA_ONLY:
                case["kernels"][name] = {"not_applicable": f"{CUDA_ONLY[name]} (device {dev.type})"}
                continue
            if not_installed(name):
                case["kernels"][name] = {"not_installed": not_installed(name)}
                print(json.dumps({"L": L, "kernel": name, **case["kernels"][name]}), flush=True)
                continue
            if time.time() - start > a.time_budget:
                case["kernels"][name] = {"skipped": f"time budget of {a.time_budget:.0f} s spent"}
                save()
                continue
            try:
                backward = not (name == "flex" and dev.type != "cuda")
                cell = check_kernel(name, q, k, v, mask, scale, d_out, d_lse, ref, backward)
                if dev.type == "cuda" and not a.no_timing:
                    kernel = get_kernel(name, dev)
                    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

                    def fwd():
                        with torch.no_grad():
                            _call(kernel, name, q, k, v, mask, scale)

                    def fwd_bwd():
                        o, l = _call(kernel, name, qg, kg, vg, mask, scale)
                        o.backward(d_out)

                    # One warm fwd+bwd first: a kernel too slow for the time left is reported, not timed.
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fwd_bwd()
                    torch.cuda.synchronize()
                    warm = time.perf_counter() - t0
                    left = a.time_budget - (time.time() - start)
                    if warm * (2 * a.reps + 4) > left:
                        cell["speed"] = {"skipped": f"warm fwd+bwd {warm:.2f} s, {left:.0f} s of the budget left"}
                    else:
                        cell["speed"] = speed(fwd, fwd_bwd, pairs, H, d, a.reps)
            except Exception as exc:  # a failure; record and go on: one broken kernel must not hide the others
                cell = {"error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-1500:]}
            case["kernels"][name] = cell
            print(json.dumps({"L": L, "kernel": name, **{k_: v_ for k_, v_ in cell.items() if k_ != "trace"}}), flush=True)
            save()
        if dev.type == "cuda" and not a.no_timing:
            # K/V repeated to H heads: SDPA's flash backend then runs whatever its GQA support
            qt, kt, vt = (x.detach().repeat_interleave(H // x.shape[2], 2).permute(1, 2, 0, 3).contiguous()
                          .requires_grad_() for x in (q, k, v))
            gt = d_out.permute(1, 2, 0, 3).contiguous()
            flash = torch.nn.attention.SDPBackend.FLASH_ATTENTION
            F = torch.nn.functional

            def sdpa_fwd():
                with torch.no_grad(), torch.nn.attention.sdpa_kernel(flash):
                    F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)

            def sdpa_fwd_bwd():
                with torch.nn.attention.sdpa_kernel(flash):
                    F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale).backward(gt)

            try:
                case["sdpa_flash_causal"] = {"pairs": L * (L + 1) // 2, **speed(sdpa_fwd, sdpa_fwd_bwd, L * (L + 1) // 2, H, d, a.reps)}
            except Exception as exc:
                case["sdpa_flash_causal"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(json.dumps({"L": L, "sdpa_flash_causal": case["sdpa_flash_causal"]}), flush=True)
        del ref
        save()
    if a.wide_rows:
        wide(a, dev, dtype, report, save)
    save()
    print(f"wrote {a.out}: ok={report['ok']} in {report['wall_s']:.0f} s", flush=True)
    for line in report["failed"]:
        print(f"FAILED {line}", flush=True)
    for line in report["not_applicable"]:
        print(f"not applicable here: {line}", flush=True)
    for line in report["not_installed"]:
        print(f"not installed (not run, not passed): {line}", flush=True)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
