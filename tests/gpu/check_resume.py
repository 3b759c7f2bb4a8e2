"""One training run, a save and an exact resume, through the plugin's trainer as a user runs it
(`python -m megatron_csbp.train`, one process: nccl on CUDA, gloo without; Megatron's local spec with
the block-diffusion core attention, the default kernel: Flex on CUDA; mock data; bf16 on CUDA).

Run A trains ITERS iterations and saves after each (`--save D --save-interval 1`); run B resumes
from A's first checkpoint (`--load D --ckpt-step 1`) and trains to the same ITERS. The claim, bit for
bit (same device, same inputs; the noise is keyed by the global sample index, the optimizer,
scheduler and RNG state are in the checkpoint): B's losses and gradient norms at iterations
2..ITERS equal A's. Iteration 2's loss is a forward of the restored weights; iteration 3's also needs
the restored optimizer state (Adam's moments and step: a wrong bias correction moves it). A
difference is reported with both values, never rounded away.

    python tests/gpu/check_resume.py --out resume.json                 (CUDA: nccl, bf16)
    python tests/gpu/check_resume.py --device cpu --out resume.json    (gloo, tiny; the dry run adds --bf16)

Exit status 0 when both runs end and the curves agree, 1 otherwise; a run past --timeout is killed
and reported in the JSON like any other failure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 3
RESERVE_S = 30.0  # of --timeout, kept for the resumed run (warm: inductor's cache holds the compiled Flex)
COMMON = ("--mock-data --num-attention-heads 4 --num-query-groups 2 --block-size 16 --micro-batch-size 2 "
          "--global-batch-size 2 --log-interval 1 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 --no-progress-bar "
          "--transformer-impl local").split()
SIZE = {"cuda": "--vocab-size 1024 --num-layers 2 --hidden-size 256 --seq-length 512 --bf16".split(),
        "cpu": "--vocab-size 64 --num-layers 2 --hidden-size 32 --seq-length 32".split()}


def _run(argv, log, timeout):
    """(return code, stderr, logged records, seconds); a run past `timeout` is killed (its return
    code "timeout") and what it logged is kept."""
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_csbp.train"] + argv + ["--log-json", log],
                              capture_output=True, text=True, timeout=max(1.0, timeout), cwd=ROOT)
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr or b""
        rc = "timeout"
        stderr = (err.decode(errors="replace") if isinstance(err, bytes) else err) + \
            f"\nkilled after {max(1.0, timeout):.0f} s (check_resume --timeout)"
    records = []
    if os.path.exists(log):
        with open(log) as f:
            records = [json.loads(line) for line in f if line.strip()]
    return rc, stderr, records, time.time() - t0


def _curve(records, key):
    return {r["iteration"]: r[key] for r in records if key in r}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--timeout", type=float, default=110.0,
                   help="seconds for both runs together (the first may leave the second RESERVE_S)")
    p.add_argument("--kernel", default="auto", help="--attention-kernel of both runs")
    p.add_argument("--bf16", action="store_true", help="bf16 on --device cpu too (always on cuda)")
    p.add_argument("--tiny", action="store_true", help="the CPU sizes on any device (the CUDA-shaped run)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("check_resume: --device cuda but no CUDA device (use --device cpu for the dry run)", file=sys.stderr)
        return 2
    report = {"device": a.device, "backend": "nccl" if a.device == "cuda" else "gloo", "iterations": ITERS,
              "spec": "local", "kernel": a.kernel,
              "claim": "resumed losses and grad norms at iterations 2..N equal the uninterrupted run's bit for bit"}
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="csbp-resume-") as tmp:
        save = os.path.join(tmp, "ckpt")
        base = COMMON + SIZE["cpu" if a.tiny else a.device] + ["--train-iters", str(ITERS), "--distributed-backend", report["backend"],
                                          "--attention-kernel", a.kernel]
        if a.bf16 and "--bf16" not in base:
            base.append("--bf16")
        report["bf16"] = "--bf16" in base
        runs = {}
        for name, extra in (("uninterrupted", ["--save", save, "--save-interval", "1"]),
                            ("resumed", ["--load", save, "--ckpt-step", "1"])):
            if runs.get("uninterrupted", {}).get("returncode", 0) != 0:
                runs[name] = {"returncode": "not run", "loss": {}, "grad_norm": {},
                              "why": "the uninterrupted run did not finish"}
                continue
            left = a.timeout - (time.time() - start) - (RESERVE_S if name == "uninterrupted" else 0)
            rc, stderr, records, seconds = _run(base + extra, os.path.join(tmp, f"{name}.jsonl"), left)
            runs[name] = {"returncode": rc, "seconds": round(seconds, 1), "loss": _curve(records, "loss"),
                          "grad_norm": _curve(records, "grad_norm")}
            if rc != 0:
                runs[name]["stderr_tail"] = stderr[-3000:]
                print(stderr[-3000:], file=sys.stderr)
            if name == "uninterrupted":
                runs[name]["checkpoints"] = sorted(os.listdir(save)) if os.path.isdir(save) else []
    report["runs"] = runs
    a_, b_ = runs["uninterrupted"], runs["resumed"]
    problems = [f"{n} run " + ("ran out of time" if r["returncode"] == "timeout" else f"exited {r['returncode']}")
                for n, r in runs.items() if r["returncode"] not in (0, "not run")]
    want = list(range(2, ITERS + 1))
    for key in ("loss", "grad_norm"):
        for it in want:
            va, vb = a_[key].get(it), b_[key].get(it)
            if va is None or vb is None:
                problems.append(f"iteration {it}: no {key} logged (uninterrupted {va}, resumed {vb})")
            elif va != vb:
                problems.append(f"iteration {it}: {key} {vb!r} after the resume, {va!r} uninterrupted "
                                f"(relative difference {abs(va - vb) / max(abs(va), 1e-30):.3e})")
    if sorted(b_["loss"]) != want:
        problems.append(f"the resumed run logged iterations {sorted(b_['loss'])}, expected {want}")
    report["problems"], report["ok"] = problems, not problems
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
    for line in problems:
        print(f"FAILED {line}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
