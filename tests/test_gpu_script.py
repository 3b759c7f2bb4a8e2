"""The CPU part of tests/gpu/run_all.sh (`--cpu-dry-run`): every step's script at tiny size on CPU,
no timings, and the one JSON of results. Kernels with a CPU path must pass the bf16 tolerances
against dense fp64; flash-attn (CUDA only) is reported "not_applicable" by name on CPU. A kernel
that fails to import or to run is a failure (report not ok, exit 1), never left out of the verdict;
a step that runs out of its time limit is a failure; a check whose package is missing is "not
installed", never a pass. prepare.sh's requirement check against the test machine's image."""
import json
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))


def test_run_all_cpu_dry_run(tmp_path):
    # no carried wheels here: the environment's own megatron-core and transformers
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", PYTHON=sys.executable,
               CSBP_GPU_WHEELS=str(tmp_path / "no-wheels"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu", "run_all.sh"), "--cpu-dry-run"], env=env,
                          capture_output=True, text=True, timeout=590)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.load(open(tmp_path / "gpu_results.json"))
    assert results["ok"] and results["mode"] == "cpu-dry-run" and results["failed"] == []
    assert results["passed"] == ["env", "kernels", "gpt", "resume", "speed", "moe"]
    assert results["not_installed"] == []  # on CPU flash-attn and TE are not applicable, not "not installed"
    assert "reference_kernels: not applicable: CUDA kernel rates (cpu-dry-run)" in results["not_applicable"]
    assert "run_all summary (cpu-dry-run): 6 passed" in proc.stdout
    env_report = json.load(open(tmp_path / "env.json"))
    assert env_report["ok"] and env_report["megatron_core"] and env_report["device"] == "cpu"
    report = json.load(open(tmp_path / "gpu_kernels.json"))
    assert report["ok"] and report["device"] == "cpu" and len(report["cases"]) == 2
    wide = report["cases"][1]  # a 512-wide layer: the kernel auto takes on CPU, forward and backward vs fp64
    assert wide["head_dim"] == 512 and wide["auto_kernel"] == "cpu_flash"
    assert wide["kernels"]["cpu_flash"]["fwd"]["ok"] and wide["kernels"]["cpu_flash"]["bwd"]["ok"]
    assert report["failed"] == [] and report["not_installed"] == []
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
    # the GPT step: the local spec in bf16 against the same weights in float64 (math kernel), within
    # 8u on the loss and the gradients; TE did not run and says why
    te = json.load(open(tmp_path / "te_spec.json"))
    assert te["ok"] and te["local_ok"] and te["device"] == "cpu" and te["te"].startswith("not run")
    assert 0 < te["loss_err_local"] < 8 * te["u_bf16"] and 0 < te["grad_err_local"] < 8 * te["u_bf16"]
    # the resume step: two trainer runs (gloo here), the resumed curve equal bit for bit
    resume = json.load(open(tmp_path / "resume.json"))
    assert resume["ok"] and resume["backend"] == "gloo" and resume["bf16"] and resume["problems"] == []
    runs = resume["runs"]
    assert runs["uninterrupted"]["checkpoints"] == ["iter_0000001", "iter_0000002", "iter_0000003",
                                                    "latest_checkpointed_iteration.txt"]
    assert sorted(runs["resumed"]["loss"]) == ["2", "3"]  # JSON keys
    assert all(runs["resumed"][k][i] == runs["uninterrupted"][k][i] for k in ("loss", "grad_norm") for i in ("2", "3"))
    # the speed step measured the block-diffusion attention and causal SDPA at one length
    speed = json.load(open(tmp_path / "speed.json"))
    assert speed["ok"] and [c["tokens"] for c in speed["cases"]] == [128]
    c = speed["cases"][0]
    assert c["causal_pairs"] == 128 * 129 // 2 and c["causal_pairs"] < c["allowed_pairs"] < (2 * 128) ** 2
    assert c["block_diffusion"]["fwd_bwd_ms"] > 0 and c["sdpa_causal"]["fwd_bwd_ms"] > 0


def _steps(tmp_path, rows, files=None):
    (tmp_path / "steps.tsv").write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))
    for name, data in (files or {}).items():
        (tmp_path / name).write_text(json.dumps(data))
    import gpu_env

    return gpu_env.summary(str(tmp_path), "gpu", 400)


def test_summary_counts_every_exit_status_and_never_passes_what_did_not_run(tmp_path):
    """A step out of time (exit 124) or whose JSON is missing is a failure; flash-attn and TE missing
    are listed as not installed and are not passes; a passing step needs exit 0 and its JSON."""
    r = _steps(tmp_path, [("env", 0, 3, 45, "env.json"), ("kernels", 0, 50, 90, "k.json"),
                          ("gpt", 0, 20, 60, "te.json"), ("resume", 124, 130, 130, "resume.json"),
                          ("speed", 0, 10, 85, "missing.json"),
                          ("reference_kernels", "not_run", 0, 0, "not installed: flash-attn")],
               {"env.json": {"ok": True}, "k.json": {"ok": True, "not_installed": ["flash: flash-attn is not installed"]},
                "te.json": {"ok": True, "te": "not installed: transformer_engine does not import"},
                "resume.json": {"ok": False}})
    assert not r["ok"] and r["passed"] == ["env", "kernels", "gpt"] and r["failed"] == ["resume", "speed"]
    steps = {s["name"]: s for s in r["steps"]}
    assert "ran out of its 130 s limit" in steps["resume"]["why"] and "missing.json missing" in steps["speed"]["why"]
    assert steps["reference_kernels"]["status"] == "not installed"
    assert r["not_installed"] == ["kernels: flash: flash-attn is not installed",
                                  "gpt: TransformerEngine spec: not installed: transformer_engine does not import",
                                  "reference_kernels: not installed: flash-attn"]
    assert json.load(open(tmp_path / "gpu_results.json"))["failed"] == ["resume", "speed"]
    ok = _steps(tmp_path, [("env", 0, 3, 45, "env.json")], {"env.json": {"ok": True}})
    assert ok["ok"] and ok["failed"] == []


def _wheel(path, name, version, requires):
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)


def test_prepare_checks_every_requirement_against_the_image(tmp_path):
    """prepare.sh's check (gpu_env.static): each wheel of WHEELS at its version, one version of
    each, every requirement met by the image's versions or another wheel. transformers 5.25 needs
    huggingface-hub >= 2.4 (the image has 1.33.0) and `kernels` (the image has none)."""
    import gpu_env

    good = tmp_path / "good"
    good.mkdir()
    _wheel(good / "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl", "megatron-core", "0.19.2",
           ["torch>=2.6.0", "numpy", "packaging>=24.2", 'wandb; extra == "training"'])
    _wheel(good / "transformers-5.24.0-py3-none-any.whl", "transformers", "5.24.0",
           ["huggingface-hub<3.0,>=1.31.0", "tokenizers<0.24.0,>=0.23.1", "safetensors>=0.8.0",
            'torch>=2.4; extra == "torch"', 'pywin32; sys_platform == "win32"'])
    assert gpu_env.static(str(good)) == []
    bad = tmp_path / "bad"
    bad.mkdir()
    _wheel(bad / "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl", "megatron-core", "0.19.2", ["torch>=2.12"])
    _wheel(bad / "transformers-5.25.0-py3-none-any.whl", "transformers", "5.25.0",
           ["huggingface-hub<3.0,>=2.4.0", "kernels<0.20,>=0.19.1"])
    _wheel(bad / "transformers-5.24.0-py3-none-any.whl", "transformers", "5.24.0", [])
    problems = gpu_env.static(str(bad))
    assert any(p.startswith("two wheels of transformers") for p in problems)
    assert "megatron-core 0.19.2 needs torch>=2.12: the image has torch 2.11.0" in problems
    assert any("needs huggingface-hub<3.0,>=2.4.0: the image has huggingface-hub 1.33.0" in p for p in problems)
    assert any("needs kernels" in p and "neither the image nor a wheel" in p for p in problems)


def test_a_kernel_that_fails_to_import_or_run_is_a_failure(tmp_path, monkeypatch):
    """An unknown or unimportable kernel, and one that raises in its forward, make the report not
    ok with the kernel named; the kernels that work are still checked."""
    import check_kernels

    from megatron_csbp.attention.kernels import registry as kernels

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


def test_a_kernel_whose_package_is_missing_is_not_installed_never_passed(tmp_path, monkeypatch):
    """Where flash-attn is not installed (this machine), the flash kernel is reported "not
    installed" by name: not run, not a pass, not a failure; the kernels that ran decide `ok`. (On
    CPU the CUDA-only rule comes first; cleared here to reach the package rule.)"""
    import importlib.util

    import check_kernels

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else find_spec(name, *a))
    monkeypatch.setattr(check_kernels, "CUDA_ONLY", {})
    report = check_kernels.main(["--device", "cpu", "--lengths", "64", "--block-size", "16", "--heads", "2",
                                 "--groups", "1", "--head-dim", "16", "--math-max-rows", "0", "--no-timing",
                                 "--kernels", "tiled", "flash", "--out", str(tmp_path / "r.json")])
    assert report["ok"] and report["failed"] == []
    assert report["not_installed"] == ["flash: flash-attn is not installed"]
    assert report["cases"][0]["kernels"]["flash"] == {"not_installed": "flash-attn is not installed"}


def _plan(*args):
    proc = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu", "run_all.sh"), "--plan", *args],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, CSBP_GPU_WHEELS="/no-wheels"))
    return proc.returncode, proc.stdout, proc.stderr


def test_gpu_limits_fit_six_minutes_and_one_step_reruns_alone():
    """The GPU steps' limits, each with timeout's kill grace, sum to at most 360 s (a 15-minute visit
    then holds a rerun); speed runs one length (each adds cold Flex compiles), the longer ones only
    with --only speed_long; --only runs install and that step, --limit sets its limit; a step name
    that does not exist is one error line."""
    rc, out, _ = _plan()
    steps = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("step ")}
    assert rc == 0 and list(steps) == ["install", "env", "kernels", "gpt", "resume", "speed", "moe"], out
    assert sum(int(s[2]) + int(s[3]) for s in steps.values()) <= 360
    assert all(int(s[3]) > 0 for s in steps.values())  # timeout -k: a killed step's trainer does not outlive it
    speed = steps["speed"]
    assert speed[speed.index("--tokens") + 1:speed.index("--out")] == ["8192"]
    rc, out, _ = _plan("--only", "speed_long", "--limit", "200")
    assert rc == 0 and [line.split()[1:3] for line in out.splitlines()] == [["install", "15"], ["speed_long", "200"]]
    assert "--tokens 32768 131072" in out
    rc, out, _ = _plan("--only", "nope")
    assert rc == 2 and out.strip().splitlines() == [
        "error: --only must be one of: install env kernels gpt resume speed moe speed_long reference_kernels (got 'nope')"]


def test_a_step_out_of_time_still_leaves_its_json(tmp_path):
    """`--only speed --limit 1`: the step is killed, its JSON says so, the summary fails it by name."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, CSBP_GPU_WHEELS=str(tmp_path / "no-wheels"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu", "run_all.sh"), "--cpu-dry-run", "--only", "speed",
                           "--limit", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert json.load(open(tmp_path / "speed.json")) == {"ok": False, "error": "killed: ran out of its 1 s limit (exit 124)"}
    results = json.load(open(tmp_path / "gpu_results.json"))
    assert results["failed"] == ["speed"] and results["passed"] == [] and [s["name"] for s in results["steps"]] == ["speed"]
    assert "run_all summary (cpu-dry-run --only speed): 0 passed [], 1 failed [speed]" in proc.stdout


def test_check_resume_writes_its_json_when_a_run_times_out(tmp_path):
    """A trainer run past --timeout is killed (subprocess.TimeoutExpired), and the JSON still says what
    happened: the uninterrupted run ran out of time, the resumed run was not started."""
    import check_resume

    out = tmp_path / "resume.json"
    assert check_resume.main(["--device", "cpu", "--timeout", "1", "--out", str(out)]) == 1
    report = json.load(open(out))
    assert not report["ok"] and report["runs"]["uninterrupted"]["returncode"] == "timeout"
    assert "killed after 1 s" in report["runs"]["uninterrupted"]["stderr_tail"]
    assert report["runs"]["resumed"]["returncode"] == "not run"
    assert report["problems"][0] == "uninterrupted run ran out of time"


def _shaped(tmp_path, *args):
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", PYTHON=sys.executable,
               CSBP_GPU_WHEELS=str(tmp_path / "no-wheels"), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu", "run_all.sh"), "--cuda-shaped", *args], env=env,
                          capture_output=True, text=True, timeout=900)
    return proc, json.load(open(tmp_path / "gpu_results.json"))


@pytest.mark.cuda_shaped
def test_run_all_cuda_shaped_kernels(tmp_path):
    """check_kernels.py as run_all.sh runs it, on the CUDA-shaped device in bf16: its mask and inputs
    on the kernels' device, tiled and math against fp64, and the 512-wide layer on the kernel auto
    takes on CUDA (tiled)."""
    proc, results = _shaped(tmp_path, "--only", "kernels")
    assert proc.returncode == 0 and results["passed"] == ["kernels"], proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.load(open(tmp_path / "gpu_kernels.json"))
    assert report["config"]["dtype"] == "bfloat16" and report["device"] == "cuda-shaped (CPU)"
    (main, wide) = report["cases"]
    assert all(c["fwd"]["ok"] and c["bwd"]["ok"] for c in main["kernels"].values()) and sorted(main["kernels"]) == ["math", "tiled"]
    assert wide["head_dim"] == 512 and wide["auto_kernel"] == "tiled" and wide["kernels"]["tiled"]["bwd"]["ok"]


@pytest.mark.slow
@pytest.mark.cuda_shaped
def test_run_all_cuda_shaped(tmp_path):
    """Every GPU check script end to end on the CUDA-shaped device (bf16, nccl groups, tiny sizes)."""
    proc, results = _shaped(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert results["passed"] == ["env", "kernels", "gpt", "resume", "speed", "moe"] and results["failed"] == []
    resume = json.load(open(tmp_path / "resume.json"))
    assert resume["backend"] == "nccl" and resume["bf16"] and resume["device"] == "cuda"
