"""Imports run one way (docs/architecture.md "Layers"): every import statement of megatron_csbp/, lazy
ones inside functions included, read from the source with `ast`.

- `LAYERS` orders the package low to high; no module imports a module of a higher layer;
- no import circle joins files of different folders (strongly connected components of the module
  graph; a circle inside one folder, e.g. a package registering its members, is that folder's own);
- each rule of `RULES` names a direction that once ran both ways inside one layer.

A violation that only a change in another branch can fix is listed in `ALLOWED` by name, with the
reason; an entry that no longer matches an import fails, so the list only shrinks."""
import ast
import functools
import os
import re
from typing import Optional

import pytest

PKG = os.path.join(os.path.dirname(__file__), "..", "megatron_csbp")

#: low to high; a module belongs to the entry with the longest matching prefix
LAYERS = [
    ("utils", ["megatron_csbp.utils"]),
    ("compat", ["megatron_csbp.compat"]),
    ("layout", ["megatron_csbp.layout"]),
    ("parallel", ["megatron_csbp.parallel", "megatron_csbp.parallel.state", "megatron_csbp.parallel.pipeline", "megatron_csbp.parallel.self_conditioning",
                  "megatron_csbp.parallel.spawn"]),
    # one rank's attention and the plans it runs (attention/feed.py, attention/dflash.py: a layout's
    # rows as an AttentionPlan)
    ("attention", ["megatron_csbp.attention"]),
    ("data", ["megatron_csbp.data"]),
    ("objectives", ["megatron_csbp.objectives"]),
    # LoRA adapters on megatron-core's parallel linears and their flags (below config/, which adds
    # the flags to the trainer's table; model/ calls its spec transform)
    ("lora", ["megatron_csbp.lora"]),
    # every option declared once (name, type, default, help, rule, where it goes): the parser,
    # TrainerConfig, the model builder, the families' printed flags and the Megatron-LM hooks read it
    ("config", ["megatron_csbp.config"]),
    ("model", ["megatron_csbp.model"]),
    ("checkpoint", ["megatron_csbp.checkpoint"]),
    ("training", ["megatron_csbp.training", "megatron_csbp.training.megatron_lm"]),
    # decoding a trained checkpoint rebuilds its model from the saved flags (training.model)
    ("generation", ["megatron_csbp.generation"]),
    ("conversion", ["megatron_csbp.conversion"]),
    # the planner and the benchmarks; `plan` and `bench` run them
    ("tools", ["megatron_csbp.planner", "megatron_csbp.bench", "megatron_csbp.bench.decoding"]),
    ("apps", ["megatron_csbp.train", "megatron_csbp.generate", "megatron_csbp.convert", "megatron_csbp.dflash",
              "megatron_csbp.launch",  # the module today, the package after the move (relayout: keep)
              "megatron_csbp.launch.nemo", "megatron_csbp.launch.torchrun",
              "megatron_csbp.explain", "megatron_csbp.plan", "megatron_csbp.demo"]),
]

#: (importer, imported, why the direction is the other way) inside one layer
RULES = [
    ("megatron_csbp.objectives", "megatron_csbp.model", "a model registers itself for its objective (model.bdlm.register_wrapper)"),
    ("megatron_csbp.objectives", "megatron_csbp.training", "a model builder registers itself for its objective (training.model.register_chunk_builder)"),
    ("megatron_csbp.model", "megatron_csbp.conversion", "conversion/ reads model/families/, never the reverse"),
    ("megatron_csbp.attention.kernels.flash", "megatron_csbp.attention.kernels.registry", "kernels is the registry of flash"),
    ("megatron_csbp.attention.kernels.flex", "megatron_csbp.attention.kernels.registry", "kernels is the registry of flex"),
    ("megatron_csbp.attention.kernels.cpu_flash", "megatron_csbp.attention.kernels.registry", "kernels is the registry of cpu_flash"),
    ("megatron_csbp.attention.kernels.tiled", "megatron_csbp.attention.kernels.registry", "kernels is the registry of tiled"),
    ("megatron_csbp.attention.merge", "megatron_csbp.attention.kernels", "the merge imports no kernel"),  # relayout: keep
]

#: (importer module, imported module): why it is still there and what removes it
ALLOWED = {}


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


#: "megatron_csbp.a.b:attr": a name resolved by string (`importlib.import_module` + `getattr`)
MODULE_ATTR = re.compile(r"^(megatron_csbp(?:\.\w+)*):\w+$")
#: calls that start a process
LAUNCHERS = ("subprocess.", "os.system", "os.exec", "os.spawn", "runpy.", "multiprocessing.Process")


def imports_of(path: str, module: Optional[str] = None):
    """Every module `path` names: import statements (from-imports as `module.name` too, so
    `from megatron_csbp import dflash` counts as importing megatron_csbp.dflash; relative ones
    resolved against `module`, this file's module name), `import_module("...")` literals and
    "module:attr" strings."""
    module = module or module_name(path)
    package = module if os.path.basename(path) == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            out.add(source)
            out.update(f"{source}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).rpartition(".")[2] == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.add(node.args[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_ATTR.match(node.value):
            out.add(MODULE_ATTR.match(node.value).group(1))
    return out


def app_launches(path: str):
    """The apps `path` starts as a process: a string naming an app module (`-m megatron_csbp.generate`)
    in a file that calls a process launcher."""
    tree = ast.parse(open(path).read(), path)
    if not any(isinstance(n, ast.Call) and ast.unparse(n.func).startswith(LAUNCHERS) for n in ast.walk(tree)):
        return []
    apps = [p for _, prefixes in LAYERS[-1:] for p in prefixes]
    return sorted({f"{os.path.relpath(path, PKG)}:{n.lineno} {a}" for n in ast.walk(tree) for a in apps
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)
                   and re.search(rf"(^|-m\s+){re.escape(a)}(\s|$)", n.value)})


def package_files():
    """Every .py file of megatron_csbp/."""
    return [os.path.join(dirpath, f) for dirpath, _, files in os.walk(PKG) for f in files if f.endswith(".py")]


@functools.lru_cache(maxsize=None)
def package_imports():
    return {module_name(path): imports_of(path) for path in package_files()}


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@functools.lru_cache(maxsize=None)
def module_graph():
    """module -> the package modules it imports: `from a.b import c` is a.b.c when that is a module,
    else a.b (importing a submodule runs its package's __init__, which every such package keeps light)."""
    mods = package_imports()

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, names in mods.items():
        targets = {resolve(n) for n in names if within(n, "megatron_csbp")}
        # `from pkg import sub` names pkg too: drop pkg where a submodule of it was the target
        targets = {t for t in targets if not any(u != t and within(u, t) and u in _named_submodules(mod, t)
                                                  for u in targets)}
        graph[mod] = sorted(t for t in targets if t and t != mod and t != "megatron_csbp")
    return graph


def _named_submodules(mod, package):
    return {n for n in package_imports()[mod] if n.rpartition(".")[0] == package}


def layer_of(module: str) -> int:
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes if within(module, p)),
               default=None)
    return None if best is None else best[1]


def folder_of(module: str) -> str:
    """The folder a module's file is in, at any depth (model.families.gpt -> model.families; a
    package's __init__ belongs to its own folder)."""
    return module if os.path.isdir(os.path.join(PKG, *module.split(".")[1:])) else module.rpartition(".")[0]


def strongly_connected(graph):
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan (the graph is a few hundred modules deep at most)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    lost = sorted(m for m in package_imports() if m != "megatron_csbp" and layer_of(m) is None)
    assert not lost, f"place these modules in LAYERS (tests/test_import_directions.py): {lost}"


def test_no_module_imports_a_higher_layer():
    up = sorted(f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
                for a, targets in module_graph().items() for b in targets
                if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)
                and (a, b) not in ALLOWED)
    assert not up, "imports up the layer order (docs/architecture.md): " + "; ".join(up)


def circles_across_folders(graph):
    return [c for c in strongly_connected(graph) if len({folder_of(m) for m in c}) > 1]


def test_no_import_circle_between_folders():
    graph = {a: [b for b in targets if (a, b) not in ALLOWED] for a, targets in module_graph().items()}
    circles = circles_across_folders(graph)
    assert not circles, "import circles across folders: " + "; ".join(
        " <-> ".join(c) + " via " + ", ".join(f"{a}->{b}" for a in c for b in graph[a] if b in c) for c in circles)


def test_allowed_exceptions_still_exist():
    print(f"{len(ALLOWED)} allowed exception(s): " + "; ".join(f"{a} -> {b}" for a, b in ALLOWED))
    stale = sorted(f"{a} -> {b}" for a, b in ALLOWED if b not in module_graph().get(a, ()))
    assert not stale, f"delete these ALLOWED entries, the import is gone: {stale}"


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


def test_the_circle_finder_sees_a_lazy_circle_across_folders():
    graph = {"megatron_csbp.data.x": ["megatron_csbp.objectives.y"], "megatron_csbp.objectives.y": ["megatron_csbp.data.x"],
             "megatron_csbp.objectives.z": []}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [["megatron_csbp.data.x", "megatron_csbp.objectives.y"]]


def test_the_circle_finder_sees_a_circle_across_sub_folders():
    """model/ and model/families/ are two folders: a circle between them is caught, one inside
    model/families/ (a package importing the members that register themselves) is not."""
    across = {"megatron_csbp.model.builder": ["megatron_csbp.model.families.gpt"],
              "megatron_csbp.model.families.gpt": ["megatron_csbp.model.builder"]}
    inside = {"megatron_csbp.model.families": ["megatron_csbp.model.families.gpt"],
              "megatron_csbp.model.families.gpt": ["megatron_csbp.model.families"]}
    assert circles_across_folders(across) == [sorted(across)]
    assert circles_across_folders(inside) == []


def test_the_reader_resolves_relative_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from ..model.bdlm import X\nfrom . import base\nfrom .registry import y\n")
    names = imports_of(str(src), "megatron_csbp.objectives.m")
    assert {"megatron_csbp.model.bdlm", "megatron_csbp.objectives.base", "megatron_csbp.objectives.registry"} <= names
    assert layer_of("megatron_csbp.objectives.m") < layer_of("megatron_csbp.model.bdlm")  # so it is caught going up


def test_the_reader_sees_import_module_literals_and_module_attr_strings(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import importlib\nW = 'megatron_csbp.model.bdlm:BlockDiffusionModel'\n"
                   "def f():\n    return importlib.import_module('megatron_csbp.training.drafter')\n")
    assert {"megatron_csbp.model.bdlm", "megatron_csbp.training.drafter"} <= imports_of(str(src), "megatron_csbp.objectives.m")


def test_the_launch_finder_sees_an_app_started_as_a_process(tmp_path):
    launches, names = tmp_path / "a.py", tmp_path / "b.py"
    launches.write_text("import subprocess, sys\n"
                        "def f():\n    subprocess.run([sys.executable, '-m', 'megatron_csbp.generate', '--load', 'x'])\n"
                        "def g():\n    subprocess.run('python -m megatron_csbp.demo --steps 2', shell=True)\n")
    names.write_text("HELP = 'python -m megatron_csbp.generate'\n")  # naming an app, not starting it
    assert sorted(f.rpartition(" ")[2] for f in app_launches(str(launches))) == ["megatron_csbp.demo",
                                                                                 "megatron_csbp.generate"]
    assert app_launches(str(names)) == []


def test_library_code_launches_no_app():
    """An app is a command for a person; library code calls the library function the app calls
    (tools, e.g. the benchmarks' workers, and apps may start processes)."""
    tools = next(i for i, (name, _) in enumerate(LAYERS) if name == "tools")
    found = [f for path in package_files() if (layer_of(module_name(path)) or 0) < tools for f in app_launches(path)]
    assert not found, f"library code starts an app as a process: {found}"


def optimizer_calls(path: str):
    """Calls in `path` that build or step an optimizer: `get_megatron_optimizer(...)`, a
    `torch.optim.<Class>(...)`, and `.step(...)` / `.zero_grad(...)` on an expression naming an
    optimizer or a scheduler (`self.optimizer.step()`, `opt.zero_grad()`, `self.scheduler.step(...)`)."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        owner = ast.unparse(node.func.value).lower() if isinstance(node.func, ast.Attribute) else ""
        if (func.endswith("get_megatron_optimizer") or func.startswith("torch.optim.")
                or (func.rpartition(".")[2] in ("step", "zero_grad") and ("optim" in owner or "sched" in owner
                                                                          or owner == "opt"))):
            found.append(f"{os.path.relpath(path, PKG)}:{node.lineno} {func}")
    return found


def test_only_training_steps_an_optimizer():
    """One training loop (issue 33): only files under training/ build or step an optimizer."""
    calls = {path: optimizer_calls(path) for path in package_files()}
    inside = [c for p, cs in calls.items() if within(module_name(p), "megatron_csbp.training") for c in cs]
    outside = [c for p, cs in calls.items() if not within(module_name(p), "megatron_csbp.training") for c in cs]
    assert any("get_megatron_optimizer" in c for c in inside) and any(".step" in c for c in inside), inside
    assert not outside, f"only training/ builds or steps an optimizer: {outside}"
