"""setup.py declares every third-party module the package imports: in install_requires, or in the
extra named for the feature that imports it (`launch`, `gpu`, `test`, `megatron-lm`, `dflash-tp`)."""
import ast
import importlib.metadata
import os
import re
import runpy
import sys
from unittest import mock

import setuptools

ROOT = os.path.join(os.path.dirname(__file__), "..")

#: modules that are imported only where their feature is used, and the extra that installs them
EXTRA_OF = {"nemo_run": "launch", "flash_attn": "gpu", "transformer_engine": "gpu", "matplotlib": "test",
            "accelerate": "dflash-tp", "wandb": "wandb"}
#: Megatron-LM's training package (not on a registry: docs/megatron-lm.md) and its scripts
NOT_ON_A_REGISTRY = {"pretrain_gpt", "megatron.training", "gpt_builders", "model_provider"}
#: import name -> distribution name where they differ and packages_distributions() may not know
DIST_OF = {"yaml": "pyyaml", "megatron": "megatron-core", "flash_attn": "flash-attn",
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
