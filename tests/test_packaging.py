"""setup.py declares every third-party module the package imports: in install_requires, or in the
extra named for the feature that imports it (`launch`, `gpu`, `test`, `megatron-lm`, `dflash-tp`)."""
import ast
import importlib.metadata
import os
import re
import runpy
import sys
from unittest import mock

import pytest
import setuptools

ROOT = os.path.join(os.path.dirname(__file__), "..")

#: modules that are imported only where their feature is used, and the extra that installs them
EXTRA_OF = {"nemo_run": "launch", "flash_attn": "gpu", "transformer_engine": "gpu", "matplotlib": "test",
            "accelerate": "dflash-tp", "wandb": "wandb"}
#: Megatron-LM's training package (not on a registry: docs/megatron-lm.md) and its scripts
NOT_ON_A_REGISTRY = {"pretrain_gpt", "megatron.training", "gpt_builders", "model_provider"}
#: import name -> distribution name where they differ and packages_distributions() may not know
DIST_OF = {"google.protobuf": "protobuf", "yaml": "pyyaml", "megatron": "megatron-core", "flash_attn": "flash-attn",
           "transformer_engine": "transformer-engine", "nemo_run": "nemo-run"}


def setup_kwargs():
    with mock.patch.object(setuptools, "setup") as setup:
        runpy.run_path(os.path.join(ROOT, "setup.py"))
    return setup.call_args.kwargs


def requirement_names(reqs):
    return {re.split(r"[<>=\[;! ]", r, maxsplit=1)[0].lower() for r in reqs}


def imported_top_modules():
    """{top-level module: [file, ...]} of every import statement in megatron_csbp/."""
    found = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "megatron_csbp")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for n in names:
                    if n in NOT_ON_A_REGISTRY or any(n.startswith(m + ".") for m in NOT_ON_A_REGISTRY):
                        continue
                    found.setdefault(n.split(".")[0], []).append(os.path.relpath(path, ROOT))
    return found


def test_setup_declares_every_import():
    kw = setup_kwargs()
    required = requirement_names(kw["install_requires"])
    extras = {k: requirement_names(v) for k, v in kw["extras_require"].items()}
    assert "transformers" in required  # conversion, HF tokenizers and families import it
    assert extras["launch"] == {"nemo-run", "leptonai"}
    assert any(r.startswith("leptonai<0.27") for r in kw["extras_require"]["launch"])
    dists = importlib.metadata.packages_distributions()
    missing = []
    for module, files in sorted(imported_top_modules().items()):
        if module in sys.stdlib_module_names or module == "megatron_csbp":
            continue
        dist = DIST_OF.get(module) or (dists.get(module) or [module])[0]
        dist = dist.lower().replace("_", "-")
        where = EXTRA_OF.get(module)
        ok = dist in required if where is None else dist in extras.get(where, set())
        if not ok:
            missing.append(f"{module} (distribution {dist}, imported by {files[0]}) "
                           f"{'in install_requires' if where is None else 'in extra ' + where}")
    assert not missing, "setup.py lacks: " + "; ".join(missing)


def test_setup_declares_what_imported_modules_import():
    """The modules the package imports from a dependency (`from sentencepiece import
    sentencepiece_model_pb2`, `torch.utils.tensorboard`) import other distributions that the
    dependency may not require: each unconditional top-level import of such a module is installed
    by install_requires (directly or as a requirement of one, transitively). Issue 40: exporting a
    SentencePiece tokenizer needs protobuf, which none of them required. Modules of an extra's
    features are that extra's packages' business."""
    dists = importlib.metadata.packages_distributions()

    def dist(module):
        top = module.split(".")[0]
        known = [k for k in DIST_OF if module == k or module.startswith(k + ".")]
        name = DIST_OF[max(known, key=len)] if known else (dists.get(top) or [top])[0]
        return name.lower().replace("_", "-")

    def requires(name):
        try:
            reqs = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            return set()
        return requirement_names([r for r in reqs if "extra ==" not in r])

    # what installing install_requires installs: their requirements, transitively
    installed, todo = set(), list(requirement_names(setup_kwargs()["install_requires"]))
    while todo:
        name = todo.pop().replace("_", "-")
        if name not in installed:
            installed.add(name)
            todo += requires(name)
    missing = set()
    for module in sorted(imported_modules()):
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top == "megatron_csbp" or top in EXTRA_OF:
            continue
        path = module_file(module)
        if path is None:
            continue
        for node in ast.parse(open(path).read()).body:  # unconditional: the module's own body
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                if name.split(".")[0] in sys.stdlib_module_names or name.split(".")[0] == top:
                    continue
                if dist(name) not in installed:
                    missing.add(f"{dist(name)} (imported by {module}, which the package imports)")
    assert not missing, "setup.py install_requires lacks: " + "; ".join(sorted(missing))


def module_file(module):
    """The .py file of `module` (a package's __init__.py), found without importing anything; None
    for a name that is not a module of an installed distribution (`from module import name`)."""
    import importlib.util

    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
    if spec is None or not spec.submodule_search_locations:
        return spec.origin if spec is not None and not rest and (spec.origin or "").endswith(".py") else None
    for base in spec.submodule_search_locations:
        for path in (os.path.join(base, *rest) + ".py", os.path.join(base, *rest, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def imported_modules():
    """Every module name an import statement of megatron_csbp/ names (`from a import b`: a and a.b)."""
    found = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "megatron_csbp")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                for node in ast.walk(ast.parse(open(path).read(), path)):
                    if isinstance(node, ast.Import):
                        found.update(a.name for a in node.names)
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        found.add(node.module)
                        found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if not any(m == n or m.startswith(n + ".") for n in NOT_ON_A_REGISTRY)}


def _bounds(specifier):
    """(lowest, highest) Version a SpecifierSet admits through its >=, >, <, <=, == clauses (None:
    unbounded; a strict bound counts as the same version, which is enough to compare ranges)."""
    from packaging.version import Version

    low = high = None
    for s in specifier:
        v = Version(s.version.replace(".*", ""))
        if s.operator in (">=", ">", "==", "~=") and (low is None or v > low):
            low = v
        if s.operator in ("<", "<=", "==") and (high is None or v < high):
            high = v
    return low, high


def range_inside(ours, theirs) -> bool:
    """Is every version `ours` admits inside `theirs`' bounds?"""
    (lo, hi), (tlo, thi) = _bounds(ours), _bounds(theirs)
    return (tlo is None or (lo is not None and lo >= tlo)) and (thi is None or (hi is not None and hi <= thi))


def _requirement(reqs, name):
    from packaging.requirements import Requirement

    return [Requirement(r) for r in reqs if requirement_names([r]) == {name}]


def test_range_inside():
    from packaging.specifiers import SpecifierSet as S

    assert range_inside(S(">=2.9,<2.12"), S("<2.12.0,>=2.9.0a0")) and range_inside(S(">=2.9,<2.12"), S(""))
    assert not range_inside(S(">=2.9"), S("<2.12.0,>=2.9.0a0")) and not range_inside(S(""), S("<2.12"))
    assert not range_inside(S(">=2.8,<2.12"), S(">=2.9.0a0,<2.12.0"))


def test_gpu_extra_pins_transformer_engine_inside_megatron_cores_declared_range():
    """megatron-core declares the TransformerEngine it works with (0.16.1: `dev` extra,
    >= 2.9.0a0, < 2.12.0; 0.19.2: `te` extra, unbounded): the `gpu` extra's pin lies inside the
    installed megatron-core's declared range, in every extra that names TE."""
    ours = _requirement(setup_kwargs()["extras_require"]["gpu"], "transformer-engine")
    assert len(ours) == 1 and str(ours[0].specifier), "the gpu extra must pin transformer-engine"
    mcore = importlib.metadata.distribution("megatron-core")
    declared = _requirement(mcore.requires or [], "transformer-engine")
    assert declared, f"megatron-core {mcore.version} declares no transformer-engine requirement"
    for req in declared:
        assert range_inside(ours[0].specifier, req.specifier), (
            f"gpu extra's transformer-engine{ours[0].specifier} is not inside megatron-core {mcore.version}'s "
            f"declared {req} ({req.marker})")


def test_floors_say_what_the_code_needs():
    """torch: FlexAttention (the CUDA default) asks for the lse through `return_aux=AuxRequest(...)`,
    which torch has from 2.9 on, and megatron-core declares its own floor; flash-attn: the pin is 2.x
    (attention/flash.py calls the 2.x API) at or above the code's own minimum (2.3)."""
    from packaging.version import Version

    kw = setup_kwargs()
    torch_floor = _bounds(_requirement(kw["install_requires"], "torch")[0].specifier)[0]
    flex = open(os.path.join(ROOT, "megatron_csbp", "attention", "kernels", "flex.py")).read()
    assert "return_aux=AuxRequest" in flex
    assert torch_floor is not None and torch_floor >= Version("2.9"), f"torch>={torch_floor}: return_aux needs 2.9"
    mcore = importlib.metadata.distribution("megatron-core")
    for req in _requirement(mcore.requires or [], "torch"):
        if req.marker is None:
            assert range_inside(_requirement(kw["install_requires"], "torch")[0].specifier, req.specifier), req
    fa_low, fa_high = _bounds(_requirement(kw["extras_require"]["gpu"], "flash-attn")[0].specifier)
    code_min = re.search(r"< \((\d+), (\d+)\)", open(os.path.join(ROOT, "megatron_csbp", "attention", "kernels", "flash.py")).read())
    assert fa_low is not None and fa_low >= Version(".".join(code_min.groups())) and fa_high == Version("3")


def documented_commands():
    """module -> the files that show `python -m <module>` (README.md, docs/, examples/)."""
    shown = {}
    paths = [os.path.join(ROOT, "README.md")] + [os.path.join(d, f) for top in ("docs", "examples")
                                                 for d, _, fs in os.walk(os.path.join(ROOT, top)) for f in fs]
    for path in paths:
        if path.endswith((".md", ".py", ".sh", ".yaml")):
            for module in re.findall(r"python -m (megatron_csbp(?:\.[a-z_][a-z0-9_]*)+)", open(path).read()):
                shown.setdefault(module, set()).add(os.path.relpath(path, ROOT))
    return shown


def test_every_documented_python_m_command_is_a_runnable_module():
    """Each `python -m megatron_csbp.X` the README, docs or examples show names a module that runs as a
    script: a module with a `__main__` block or a package with `__main__.py` (issue 33: moving modules
    keeps every documented command)."""
    import importlib.util

    shown = documented_commands()
    assert {"megatron_csbp.train", "megatron_csbp.convert", "megatron_csbp.launch"} <= set(shown)
    broken = []
    for module, where in sorted(shown.items()):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
            spec = importlib.util.find_spec(module + ".__main__")
        if spec is None or '__name__ == "__main__"' not in open(spec.origin).read() and \
                not spec.origin.endswith("__main__.py"):
            broken.append(f"{module} (shown in {sorted(where)})")
    assert not broken, f"documented commands that do not run: {broken}"


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the install downloads megatron-core, transformers and their dependencies
def test_fresh_venv_with_the_packages_requirements_exports_a_sentencepiece_checkpoint(tmp_path):
    """`pip install` of the package alone into a fresh venv (only its install_requires), then
    `convert megatron-to-hf` of a checkpoint trained with the shipped SentencePiece tokenizer (issue
    40: without protobuf in install_requires the export stopped with "No module named 'google'").
    torch is constrained to the version running this test (here the CPU build in pip's find-links),
    so pip does not fetch a CUDA build of several GB; nothing else is added to the requirements."""
    import json
    import subprocess

    import torch

    from megatron_csbp.data.preprocess import main as preprocess
    from megatron_csbp.training.demo import demo_argv
    from tests.distributed import run_distributed
    from tests.test_export_trained import with_flags
    from tests.train_helpers import train_rank

    preprocess(["--input", "shipped", "--output-prefix", str(tmp_path / "pydoc"), "--append-eod"])
    save = str(tmp_path / "ckpt")
    argv = with_flags(demo_argv(1, str(tmp_path / "pydoc_text_document")), drop=("--save-initial", "--tensorboard-dir"),
                      train_iters=1, save=save, save_interval=1, eval_interval=1, eval_iters=1, log_interval=1,
                      log_json=str(tmp_path / "log.jsonl"), data_cache_path=str(tmp_path / "cache"))
    run_distributed(train_rank, 1, argv)
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    (tmp_path / "constraints.txt").write_text(f"torch=={torch.__version__}\n")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "-c", str(tmp_path / "constraints.txt"), os.path.abspath(ROOT)],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert pip.returncode == 0, pip.stderr[-3000:]
    out = subprocess.run([py, "-m", "megatron_csbp.convert", "megatron-to-hf", "--load", save, "--output",
                          str(tmp_path / "hf")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    where = subprocess.run([py, "-c", "import megatron_csbp; print(megatron_csbp.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path).stdout
    assert str(venv) in where  # the installed package ran, not this checkout
    assert json.load(open(tmp_path / "hf" / "tokenizer_config.json"))["eos_token"]
