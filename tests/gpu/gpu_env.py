"""The wheels the H200 test machine's image lacks, and the check that they fit it.

The image (/work/.library/device/KINDS.md, read 2026-11): Python 3.12.3, torch 2.11.0+cu130, triton
3.6.0, transformers 5.17.0, huggingface_hub 1.33.0, tokenizers 0.23.2, safetensors 0.8.0, numpy 2.5.2,
sentencepiece 0.2.2, tiktoken 0.14.0, einops, pytest, psutil, pyyaml, tqdm, packaging, regex, typer;
no megatron-core, flash-attn or TransformerEngine; no network. So two wheels travel (WHEELS): the
newest megatron-core this project supports on Python 3.12 (setup.py: < 0.20) and the transformers
setup.py asks for (>= 5.24; 5.24.0 is also requirements/cpu.txt's pin and the newest release whose
requirements the image meets: 5.25 needs huggingface-hub >= 2.4 and `kernels`).

    python tests/gpu/gpu_env.py static DIR            (prepare.sh: every requirement of every wheel in
                                                       DIR is met by the image's versions or by DIR)
    python tests/gpu/gpu_env.py runtime --out J.json  (run_all.sh: the same requirements checked in
                                                       the running interpreter; what is installed)
    python tests/gpu/gpu_env.py summary --out-dir D   (run_all.sh: D/steps.tsv and the steps' JSON
                                                       -> D/gpu_results.json and one summary line)

Exit status 1 when a requirement is not met (the lines say which), 0 otherwise.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import sys
import zipfile

#: what tests/gpu/prepare.sh downloads (distribution -> version)
WHEELS = {"megatron-core": "0.19.2", "transformers": "5.24.0"}

#: the image's versions (KINDS.md's pip list); None: present, version not read there (checked by
#: `runtime` on the machine itself)
IMAGE = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "huggingface-hub": "1.33.0",
         "tokenizers": "0.23.2", "safetensors": "0.8.0", "numpy": "2.5.2", "sentencepiece": "0.2.2",
         "tiktoken": "0.14.0", "accelerate": "1.15.0", "einops": None, "pytest": None, "psutil": None,
         "pyyaml": None, "tqdm": None, "packaging": None, "regex": None, "typer": None, "filelock": None,
         "fsspec": None, "requests": None, "jinja2": None, "networkx": None, "sympy": None}

#: the image's interpreter and platform, for the wheels' environment markers
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_metadata(path: str) -> tuple:
    """(name, version, [requirement strings]) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    field = lambda k: [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(k + ":")]  # noqa: E731
    return field("Name")[0], field("Version")[0], field("Requires-Dist")


def needed(requirements, env=None) -> list:
    """The requirements that apply (no extra; markers evaluated for the image, or `env`)."""
    from packaging.requirements import Requirement

    out = []
    for r in requirements:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate(dict(MARKERS if env is None else env, extra="")):
            out.append(req)
    return out


def static(wheel_dir: str) -> list:
    """Problems (empty: none) of the wheels in `wheel_dir` against the image: each wheel named in
    WHEELS at its version, one version of each, and every requirement met by the image or a wheel."""
    from packaging.version import Version

    problems, have = [], {}
    paths = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    for p in paths:
        name, version, reqs = wheel_metadata(p)
        if canonical(name) in have:
            problems.append(f"two wheels of {name}: {have[canonical(name)][0]} and {version} (pip stops on two)")
        have[canonical(name)] = (version, reqs, os.path.basename(p))
    for name, version in WHEELS.items():
        if name not in have:
            problems.append(f"{name} {version}: no wheel in {wheel_dir}")
        elif have[name][0] != version:
            problems.append(f"{name}: wheel is {have[name][0]}, WHEELS asks for {version}")
    for name, (version, reqs, fname) in sorted(have.items()):
        for req in needed(reqs):
            dep = canonical(req.name)
            if dep in have:
                got, where = have[dep][0], "wheel"
            elif dep in IMAGE:
                got, where = IMAGE[dep], "image"
            else:
                problems.append(f"{name} {version} needs {req}: neither the image nor a wheel has {req.name}")
                continue
            if got is not None and not req.specifier.contains(Version(got), prereleases=True):
                problems.append(f"{name} {version} needs {req}: the {where} has {req.name} {got}")
            print(f"  {name} {version}: {req} <- {where} {got or '(version checked on the machine)'}")
    return problems


def _version(dist: str):
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def runtime(out: str, wheel_dir: str) -> dict:
    """In the running interpreter: the versions that matter, flash-attn / TE installed or not, and
    every requirement of each wheel in `wheel_dir` met by what imports here."""
    from packaging.version import Version

    import torch

    report = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
              "cuda_available": torch.cuda.is_available(),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "megatron_core": _version("megatron-core"), "transformers": _version("transformers"),
              "flash_attn": _version("flash-attn") or "not installed",
              "transformer_engine": _version("transformer-engine") or _version("transformer-engine-torch") or "not installed",
              "apex": _version("apex") or "not installed", "problems": []}
    # where they import from, found without importing them (megatron.core's import is the slow part
    # of every later step; they import it themselves)
    import importlib.util

    for module in ("megatron.core", "transformers"):
        spec = importlib.util.find_spec(module)
        report[module.replace(".", "_") + "_from"] = os.path.dirname(spec.origin) if spec and spec.origin else None
        if spec is None:
            report["problems"].append(f"{module} does not import here")
    env = dict(MARKERS, python_version="%d.%d" % sys.version_info[:2], python_full_version=platform.python_version())
    for p in sorted(glob.glob(os.path.join(wheel_dir, "*.whl"))) if wheel_dir else []:
        name, version, reqs = wheel_metadata(p)
        if _version(name) != version:
            report["problems"].append(f"{name}: the wheel is {version}, this interpreter imports {_version(name)}")
        for req in needed(reqs, env):
            got = _version(req.name)
            if got is None or not req.specifier.contains(Version(got), prereleases=True):
                report["problems"].append(f"{name} {version} needs {req}: here {req.name} is {got or 'missing'}")
    if Version(torch.__version__.split("+")[0]) < Version("2.9"):
        report["problems"].append(f"torch {torch.__version__}: FlexAttention's return_aux needs torch >= 2.9 (setup.py)")
    report["ok"] = not report["problems"]
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))
    return report


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def summary(out_dir: str, mode: str, seconds: int) -> dict:
    """One JSON of results from run_all.sh's steps.tsv (name, exit status, seconds, limit, JSON
    file) and the steps' JSON files. A step passes only on exit status 0; 124 is a step that ran out
    of its time limit: a failure. Checks that could not run for want of a package (a step
    `not_run` "not installed: ...", flash-attn inside the kernel check, TE inside the GPT check)
    are listed under not_installed, never counted as passed."""
    steps, not_installed, not_applicable = [], [], []
    with open(os.path.join(out_dir, "steps.tsv")) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    for name, rc, secs, limit, extra in rows:
        if rc == "not_run":
            (not_installed if extra.startswith("not installed") else not_applicable).append(f"{name}: {extra}")
            steps.append({"name": name, "status": "not installed" if extra.startswith("not installed") else "not applicable",
                          "why": extra})
            continue
        rc = int(rc)
        step = {"name": name, "status": "passed" if rc == 0 else "failed", "exit": rc, "seconds": int(secs),
                "limit_s": int(limit)}
        if rc in (124, 137):  # timeout's TERM, then its KILL (-k)
            step["why"] = f"ran out of its {limit} s limit (a failure, not a skip)"
        if extra:
            step["json"] = extra
            data = _load(os.path.join(out_dir, extra))
            if data is None:
                step["status"], step["why"] = "failed", step.get("why", f"exit {rc}") + f"; {extra} missing or unreadable"
            else:
                step["result"] = data
                for line in data.get("not_installed") or []:
                    not_installed.append(f"{name}: {line}")
                te = data.get("te")
                if isinstance(te, str) and te.startswith("not installed"):
                    not_installed.append(f"{name}: TransformerEngine spec: {te}")
                for line in data.get("not_applicable") or []:
                    not_applicable.append(f"{name}: {line}")
        steps.append(step)
    failed = [s["name"] for s in steps if s["status"] == "failed"]
    passed = [s["name"] for s in steps if s["status"] == "passed"]
    report = {"mode": mode, "seconds": seconds, "steps": steps, "passed": passed, "failed": failed,
              "not_installed": not_installed, "not_applicable": not_applicable, "ok": bool(passed) and not failed}
    with open(os.path.join(out_dir, "gpu_results.json"), "w") as f:
        json.dump(report, f, indent=1)
    for s in steps:
        if s["status"] == "failed":
            print(f"FAILED {s['name']}: exit {s.get('exit')}" + (f" ({s['why']})" if "why" in s else ""))
    for line in not_installed:
        print(f"not installed (not run, not passed): {line}")
    print(f"run_all summary ({mode}): {len(passed)} passed [{' '.join(passed)}], {len(failed)} failed "
          f"[{' '.join(failed)}], {len(not_installed)} not installed, {len(not_applicable)} not applicable; "
          f"{seconds} s; {os.path.join(out_dir, 'gpu_results.json')}")
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("static")
    s.add_argument("wheel_dir")
    r = sub.add_parser("runtime")
    r.add_argument("--out", required=True)
    r.add_argument("--wheel-dir", default="")
    m = sub.add_parser("summary")
    m.add_argument("--out-dir", required=True)
    m.add_argument("--mode", default="gpu")
    m.add_argument("--seconds", type=int, default=0)
    a = p.parse_args(argv)
    if a.cmd == "summary":
        return 0 if summary(a.out_dir, a.mode, a.seconds)["ok"] else 1
    if a.cmd == "static":
        problems = static(a.wheel_dir)
        for line in problems:
            print(f"FAILED {line}")
        return 1 if problems else 0
    return 0 if runtime(a.out, a.wheel_dir)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
