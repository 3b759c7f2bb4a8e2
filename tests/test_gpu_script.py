"""The CPU part of tests/gpu/run_all.sh: the same kernel check at tiny L on CPU, no timings
(`--cpu-dry-run`). Kernels with a CPU path must pass the bf16 tolerances against dense fp64;
flash-attn (CUDA only) is reported "not_applicable" by name on CPU. A kernel that fails to import
or to run is a failure (report not ok, exit 1), never left out of the verdict."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))


def test_run_all_cpu_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu", "run_all.sh"), "--cpu-dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.load(open(tmp_path / "gpu_kernels.json"))
    assert report["ok"] and report["device"] == "cpu" and len(report["cases"]) == 1
    assert report["failed"] == []
    assert report["not_applicable"] == ["flash: flash-attn runs on CUDA only (device cpu)"]
    case = report["cases"][0]
    assert case["allowed_pairs"] < case["rectangle"]
    cells = case["kernels"]
    assert sorted(cells) == ["flash", "flex", "math", "tiled"]
    for name in ("math", "tiled"):  # forward and backward on CPU
        assert cells[name]["fwd"]["ok"] and cells[name]["bwd"]["ok"], (name, cells[name])
    assert cells["flex"]["fwd"]["ok"] and "skipped" in cells["flex"]["bwd"]
    # the bf16 error model: out rounded to bf16 (u/2 ~ 2e-3 relative), far from a wrong mask (O(1))
    assert 1e-4 < cells["flex"]["fwd"]["out_rel"] < 1e-2
    assert "FAILED" not in proc.stdout
    # the MoE-rate step's script ran its CPU part: torch's grouped GEMM equals the per-expert loop;
    # the MoE rate that would hold the planner's fitted fixed time is far below the assumed 0.30
    # (0.0734: docs/planner.md, row (f))
    moe = json.load(open(tmp_path / "reference_moe.json"))
    assert moe["ok"] and moe["device"] == "cpu" and moe["grouped_vs_loop_rel"] <= 2 ** -6 and "routed" not in moe
    assert 0.07 < moe["rate_if_moe_were_the_fixed_time"] < 0.08 < moe["assumed_grouped_gemm_efficiency"]
    # the TE-spec step's script ran its CPU part (local spec bf16 vs fp32) and says TE did not run
    te = json.load(open(tmp_path / "te_spec.json"))
    assert te["ok"] and te["device"] == "cpu" and te["te"].startswith("not run")
    assert 0 < te["loss_err_local"] < 8 * te["u_bf16"] and 0 < te["grad_err_local"] < 8 * te["u_bf16"]


def test_a_kernel_that_fails_to_import_or_run_is_a_failure(tmp_path, monkeypatch):
    """An unknown or unimportable kernel, and one that raises in its forward, make the report not
    ok with the kernel named; the kernels that work are still checked."""
    import check_kernels

    from megatron_csbp.attention import kernels

    def broken(q, k, v, mask, scale):
        raise RuntimeError("CUDA error: no kernel image is available")

    monkeypatch.setitem(kernels.KERNELS, "broken", broken)
    out = tmp_path / "r.json"
    report = check_kernels.main(["--device", "cpu", "--lengths", "64", "--block-size", "16", "--heads", "2",
                                 "--groups", "1", "--head-dim", "16", "--math-max-rows", "0", "--no-timing",
                                 "--kernels", "tiled", "broken", "nope", "--out", str(out)])
    assert not report["ok"]
    cells = report["cases"][0]["kernels"]
    assert cells["tiled"]["fwd"]["ok"] and cells["tiled"]["bwd"]["ok"]
    assert "RuntimeError: CUDA error: no kernel image is available" in cells["broken"]["error"]
    assert "--attention-kernel must be one of" in cells["nope"]["error"]
    assert [f.split(":")[0] for f in report["failed"]] == ["L=64 broken", "L=64 nope"]
    assert json.load(open(out))["ok"] is False
