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
