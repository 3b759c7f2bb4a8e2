"""Imports run one way (docs/architecture.md): every import statement of megatron_csbp/, lazy ones
inside functions included, read from the source with `ast`. Each rule below names a direction that
once ran both ways; a test fails when the reverse import comes back."""
import ast
import functools
import os

import pytest

PKG = os.path.join(os.path.dirname(__file__), "..", "megatron_csbp")


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def imports_of(path: str):
    """Every module an import statement in `path` names (from-imports as `module.name` too, so
    `from megatron_csbp import dflash` counts as importing megatron_csbp.dflash)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@functools.lru_cache(maxsize=None)
def package_imports():
    found = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                found[module_name(path)] = imports_of(path)
    return found


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


#: (importer prefix, imported prefix, why the direction is the other way)
RULES = [
    ("megatron_csbp.objectives", "megatron_csbp.model", "objectives name their model wrapper (Objective.model_wrapper)"),
    ("megatron_csbp.objectives", "megatron_csbp.dflash", "an objective names its own trainer (Objective.trainer_module)"),
    ("megatron_csbp.model", "megatron_csbp.conversion", "conversion/ reads model/families/, never the reverse"),
    ("megatron_csbp.attention.flash", "megatron_csbp.attention.kernels", "kernels is the registry of flash"),
    ("megatron_csbp.attention.flex", "megatron_csbp.attention.kernels", "kernels is the registry of flex"),
    ("megatron_csbp.attention.cpu_flash", "megatron_csbp.attention.kernels", "kernels is the registry of cpu_flash"),
    ("megatron_csbp.attention.tiled", "megatron_csbp.attention.kernels", "kernels is the registry of tiled"),
    ("megatron_csbp.attention.merge", "megatron_csbp.attention.kernels", "the merge imports no kernel"),
]


@pytest.mark.parametrize("importer,imported,why", RULES, ids=[f"{a}-x->{b}" for a, b, _ in RULES])
def test_imports_run_one_way(importer, imported, why):
    bad = sorted(f"{mod} imports {name}" for mod, names in package_imports().items() if within(mod, importer)
                 for name in names if within(name, imported))
    assert not bad, f"{why}: " + "; ".join(bad)


def test_the_reader_sees_lazy_imports(tmp_path):
    """The rules read imports inside functions too (the cycles this file guards were lazy ones)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from megatron_csbp.model.bdlm import X\n    from megatron_csbp import dflash\n")
    assert {"megatron_csbp.model.bdlm", "megatron_csbp.dflash"} <= imports_of(str(src))
