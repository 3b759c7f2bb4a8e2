"""The CPU part of tests/gpu/run_all.sh: the same kernel check at tiny L on CPU, no timings
(`--cpu-dry-run`). Kernels with a CPU path must pass the bf16 tolerances against dense fp64;
flash-attn (CUDA only) and kernels not registered on this branch are reported as missing."""
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_all_cpu_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu", "run_all.sh"), "--cpu-dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.load(open(tmp_path / "gpu_kernels.json"))
    assert report["ok"] and report["device"] == "cpu" and len(report["cases"]) == 1
    case = report["cases"][0]
    assert case["allowed_pairs"] < case["rectangle"]
    cells = case["kernels"]
    assert cells["math"]["fwd"]["ok"] and cells["math"]["bwd"]["ok"]
    assert cells["flex"]["fwd"]["ok"] and "skipped" in cells["flex"]["bwd"]
    # the bf16 error model: out rounded to bf16 (u/2 ~ 2e-3 relative), far from a wrong mask (O(1))
    assert 1e-4 < cells["flex"]["fwd"]["out_rel"] < 1e-2
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        assert cells["flash"]["missing"].endswith("--attention-kernel flash needs flash-attn; pip install flash-attn")
    tiled = cells["tiled"]
    assert "missing" in tiled or (tiled["fwd"]["ok"] and tiled["bwd"]["ok"]), tiled

