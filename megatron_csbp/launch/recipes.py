"""NeMo-style recipe launcher: `python -m megatron_csbp.launch RECIPE [options] [key=value ...]`.

A YAML recipe (sections `model`, `parallelism`, `data`, `objective`, `training`, optional
`launch`) becomes the command line of `python -m megatron_csbp.train`, run through NeMo-Run on
this machine or written as a SLURM sbatch script. Overrides: `training.train_iters=5` (or
`train_iters=5` when the key is in one section). `--check` validates without starting anything.
Format and rules: docs/recipes.md.

Examples:
  python -m megatron_csbp.launch examples/recipes/qwen3_27b_256k_csbp.yaml --check
  python -m megatron_csbp.launch examples/recipes/cpu_demo.yaml --dry-run
  python -m megatron_csbp.launch examples/recipes/cpu_demo.yaml training.train_iters=2
  python -m megatron_csbp.launch examples/recipes/nemotron_diffusion_14b_256k_csbp.yaml --slurm run.sbatch
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megatron_csbp.utils.cli import ArgumentParser, filter_warnings, run

SECTIONS = ("model", "parallelism", "data", "objective", "training")
LAUNCH_KEYS = ("nnodes", "nproc_per_node", "master_port", "env", "slurm")
SLURM_KEYS = ("job_name", "partition", "account", "time", "cpus_per_task", "output", "container_image",
              "container_mounts", "exclusive", "extra_sbatch", "setup")


class RecipeError(ValueError):
    pass


def _yaml():
    try:
        import yaml
    except ImportError as e:  # pragma: no cover
        raise RecipeError("recipes need PyYAML: pip install pyyaml") from e
    return yaml


#: the source checkout this package is in, and its shipped recipes (`launch NAME` accepts their bare names)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE_DIR = os.path.join(CHECKOUT, "examples", "recipes")

#: flags whose value is a filesystem path: a relative one in a recipe is relative to the recipe's own
#: directory (so `launch RECIPE --check` means the same from any directory); command-line overrides
#: stay relative to the current directory, like any command-line path
PATH_FLAGS = ("data_path", "data_cache_path", "sft_data_path", "train_data_path", "valid_data_path",
              "test_data_path", "load", "save", "pretrained_checkpoint", "tensorboard_dir", "wandb_save_dir",
              "features_path")
#: flags that take a path or a Hugging Face hub name: resolved like PATH_FLAGS only when that path exists
PATH_OR_NAME_FLAGS = ("tokenizer_model", "verifier")


def shipped_recipes() -> List[str]:
    """Names of the recipes under examples/recipes/ (empty when the package is installed without them)."""
    if not os.path.isdir(RECIPE_DIR):
        return []
    return sorted(os.path.splitext(f)[0] for f in os.listdir(RECIPE_DIR) if f.endswith(".yaml"))


def find_recipe(path: str) -> str:
    """A recipe file, or a shipped recipe's bare name (`cpu_demo`); otherwise an error listing them."""
    if os.path.isfile(path):
        return path
    shipped = shipped_recipes()
    name = os.path.splitext(os.path.basename(path))[0]
    if os.sep not in path and name in shipped:
        return os.path.join(RECIPE_DIR, name + ".yaml")
    listing = f"shipped recipes (in {RECIPE_DIR}): {', '.join(shipped)}" if shipped else "no shipped recipes here"
    raise RecipeError(f"recipe {path!r} does not exist; {listing}")


def _resolve_paths(recipe: Dict, base: str) -> None:
    def resolve(value, must_exist):
        if not isinstance(value, str) or value == "" or os.path.isabs(value) or PLACEHOLDER in value:
            return value
        with contextlib.suppress(ValueError):
            float(value)  # a --data-path blend weight
            return value
        path = os.path.normpath(os.path.join(base, os.path.expanduser(value)))
        return value if must_exist and not os.path.exists(path) else path

    for s in SECTIONS:
        for key, value in recipe[s].items():
            k = _norm(str(key))
            if k in PATH_FLAGS or k in PATH_OR_NAME_FLAGS:
                must = k in PATH_OR_NAME_FLAGS
                recipe[s][key] = ([resolve(v, must) for v in value] if isinstance(value, list)
                                  else resolve(value, must))


def load_recipe(path: str) -> Dict:
    path = find_recipe(path)
    with open(path) as f:
        recipe = _yaml().safe_load(f) or {}
    if not isinstance(recipe, dict):
        raise RecipeError(f"recipe {path}: the top level must be a mapping")
    unknown = set(recipe) - set(SECTIONS) - {"launch", "name", "description"}
    if unknown:
        raise RecipeError(f"recipe {path}: unknown sections {sorted(unknown)}; expected {list(SECTIONS)} and launch")
    for s in SECTIONS:
        recipe.setdefault(s, {})
        if not isinstance(recipe[s], dict):
            raise RecipeError(f"recipe {path}: section {s!r} must be a mapping of flag names to values")
    launch = recipe.setdefault("launch", {})
    for what, given, known in (("launch", launch, LAUNCH_KEYS),
                               ("launch.slurm", launch.get("slurm") or {}, SLURM_KEYS)):
        if set(given) - set(known):
            raise RecipeError(f"recipe {path}: unknown {what} keys {sorted(set(given) - set(known))}; "
                              f"expected {list(known)}")
    recipe.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    _resolve_paths(recipe, os.path.dirname(os.path.abspath(path)))
    return recipe


def placeholders(recipe: Dict) -> List[str]:
    """The recipe keys (`data.data_path`, `launch.slurm.account`) whose value still holds PLACEHOLDER."""
    def walk(prefix, node):
        if isinstance(node, dict):
            return [key for k, v in node.items() for key in walk(f"{prefix}.{k}", v)]
        return [prefix] if PLACEHOLDER in str(node) else []  # a value, or any item of a list

    return [key for s in SECTIONS + ("launch",) for key in walk(s, recipe.get(s) or {})]


def _norm(key: str) -> str:
    return key.replace("-", "_")


def apply_overrides(recipe: Dict, overrides: List[str]) -> Dict:
    yaml = _yaml()
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not KEY=VALUE")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        parts = key.split(".")
        if parts[0] in SECTIONS + ("launch",) and len(parts) >= 2:
            node = recipe[parts[0]]
            for p in parts[1:-1]:
                node = node.setdefault(_norm(p), {})
            node[_norm(parts[-1])] = value
            continue
        if len(parts) != 1:
            raise RecipeError(f"override {item!r}: the section must be one of {list(SECTIONS) + ['launch']}")
        k = _norm(key)
        owners = [s for s in SECTIONS if any(_norm(x) == k for x in recipe[s])]
        if len(owners) == 0:
            raise RecipeError(f"override {item!r}: no section has {key!r}; write SECTION.{key}=VALUE to add it")
        if len(owners) > 1:
            raise RecipeError(f"override {item!r}: {key!r} is in sections {owners}; write SECTION.{key}=VALUE")
        sec = recipe[owners[0]]
        for x in [x for x in sec if _norm(x) == k]:
            del sec[x]
        sec[k] = value
    return recipe


def recipe_flag_groups(recipe: Dict) -> List[Tuple[str, List[str]]]:
    """(flag, values) of every flag the recipe passes, in order (a bare flag has no values)."""
    groups: List[Tuple[str, List[str]]] = []
    seen = {}
    for s in SECTIONS:
        for key, value in recipe[s].items():
            name = "--" + str(key).replace("_", "-")
            if name in seen:
                raise RecipeError(f"flag {name} is set in both {seen[name]!r} and {s!r}")
            seen[name] = s
            if isinstance(value, dict):
                raise RecipeError(f"{s}.{key}: a flag value cannot be a mapping")
            if value is not None and value is not False:
                values = value if isinstance(value, (list, tuple)) else [] if value is True else [value]
                groups.append((name, [str(v) for v in values]))
    return groups


def recipe_flags(recipe: Dict) -> List[str]:
    """The command-line flags of `python -m megatron_csbp.train` for a recipe."""
    return [token for name, values in recipe_flag_groups(recipe) for token in [name] + values]


def _flag(recipe: Dict, name: str, default=None):
    return next((v for s in SECTIONS for k, v in recipe[s].items() if _norm(k) == name), default)


def check_world(recipe: Dict, nnodes: int, nproc: int) -> int:
    """Fail early, with the flag names, when the layout cannot tile the world."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's import-time notices (no TE/apex)
        from megatron_csbp.parallel.state import check_topology

    if nnodes < 1 or nproc < 1:
        raise RecipeError(f"--nnodes ({nnodes}) and --nproc-per-node ({nproc}) must be >= 1")
    world = nnodes * nproc
    try:
        check_topology(world, *(int(_flag(recipe, f"{axis}_parallel_size", 1))
                                for axis in ("tensor_model", "pipeline_model", "context", "block", "expert_model")))
    except ValueError as e:
        raise RecipeError(f"{nnodes} node(s) x {nproc} process(es): {e}") from None
    return world


#: a recipe value holding this is site-specific (a path, a tokenizer, a mask id) and filled before launch
PLACEHOLDER = "REPLACE_ME"


def check_recipe(recipe: Dict, nnodes: int, nproc: int) -> str:
    """Validate a recipe as `python -m megatron_csbp.train` would on `nnodes` x `nproc` ranks: the
    trainer's own parser (an unknown flag, a bad value or choice) and its rules (topology, sizes,
    batch, objective, ...). Starts nothing. Values holding PLACEHOLDER are listed, not parsed, and
    the rules that need files absent from this machine (a --load checkpoint, a tokenizer) are
    skipped and named. Returns a one-paragraph report; raises RecipeError naming the flag and rule."""
    world = check_world(recipe, nnodes, nproc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron_csbp.training.arguments import build_parser, validate_args

    name = recipe["name"]

    def fail(message):
        raise RecipeError(f"recipe {name} ({nnodes} node(s) x {nproc}): {message}")

    parser = build_parser()
    parser.error = fail  # argparse's messages name the flag ("argument --objective: invalid choice ...")
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    groups = recipe_flag_groups(recipe)
    unknown = [flag for flag, _ in groups if flag not in actions]
    if unknown:
        fail(f"flags that python -m megatron_csbp.train does not take: {' '.join(unknown)}")
    argv, placeholders = [], []
    for flag, values in groups:
        if any(PLACEHOLDER in v for v in values):
            placeholders.append(flag)
            if actions[flag].type in (int, float):
                continue  # no value to parse yet; the rules that need it are skipped
        argv += [flag] + values
    args = parser.parse_args(argv)
    args.placeholders = {actions[f].dest for f in placeholders}
    try:
        facts = validate_args(args, world, check_only=True)
    except ValueError as e:
        fail(str(e))
    pp = args.pipeline_model_parallel_size
    pp = f" x PP {pp}" + (f" (VP {facts.virtual_pipeline_model_parallel_size})"
                          if facts.virtual_pipeline_model_parallel_size else "") if pp > 1 else ""
    lines = [f"recipe {name}: OK for {world} ranks ({nnodes} node(s) x {nproc}): TP {args.tensor_model_parallel_size}"
             f"{pp} x CP {args.context_parallel_size} / BP {args.block_parallel_size} x DP {facts.data_parallel_size}"
             f" (EP {args.expert_model_parallel_size}), {facts.num_microbatches} micro-batch(es) per iteration"]
    if placeholders:
        lines.append(f"  placeholders to fill before launch: {' '.join(placeholders)}")
    lines += [f"  not checked here: {note}" for note in facts.check_notes]
    return "\n".join(lines)


def launch_sizes(recipe: Dict, nnodes: Optional[int], nproc: Optional[int]) -> Tuple[int, int]:
    lc = recipe["launch"]
    return int(nnodes or lc.get("nnodes") or 1), int(nproc or lc.get("nproc_per_node") or 1)


#: torchrun that forwards SIGTERM to the ranks of an --exit-signal-handler job and exits 0 once they saved
TORCHRUN = "megatron_csbp.launch.torchrun"


def torchrun_command(recipe: Dict, nnodes: int, nproc: int, python: str = sys.executable,
                     rdzv_endpoint: Optional[str] = None) -> List[str]:
    cmd = [python, "-m", TORCHRUN if _flag(recipe, "exit_signal_handler") else "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd += ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    else:
        cmd += ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", rdzv_endpoint or "$MASTER_ADDR:$MASTER_PORT"]
    return cmd + ["-m", "megatron_csbp.train"] + recipe_flags(recipe)


def requeue_safe(recipe: Dict) -> Tuple[Dict, List[str]]:
    """The recipe as a requeue-enabled SLURM job runs it (NeMo-Run's script is submitted with
    `sbatch --requeue`; Slurm requeues a preempted job and runs the same script again): with
    `--save DIR` and no `--load`, `--load DIR` is added, so the requeued job resumes the latest
    checkpoint (a `--load` that holds none yet starts from scratch, as Megatron-LM does), and
    `--exit-signal-handler` is added, so the SIGTERM of a preemption or of the time limit saves the
    iteration reached before the job ends. Returns (the recipe, notes on what a requeue does).
    A `--load` the recipe sets (a converted model to start from) is kept."""
    import copy

    save = _flag(recipe, "save")
    if not save:
        return recipe, [f"recipe {recipe['name']} sets no --save: a requeued job starts again from iteration 0"]
    recipe, notes = copy.deepcopy(recipe), []
    load = _flag(recipe, "load")
    if load is None:
        recipe["training"]["load"] = save
    elif os.path.abspath(str(load)) != os.path.abspath(str(save)):
        notes.append(f"--load {load} differs from --save {save}: a requeued job loads {load} again (set "
                     f"training.load={save} once {save} holds a checkpoint)")
    if _flag(recipe, "exit_signal_handler") is None:  # (an explicit `false` stays)
        recipe["training"]["exit_signal_handler"] = True
    return recipe, notes


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m megatron_csbp.launch", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="YAML recipe file, or a shipped recipe's name (examples/recipes/NAME.yaml)")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE or SECTION.KEY=VALUE")
    p.add_argument("--dry-run", action="store_true", help="print the command (or script) and exit")
    p.add_argument("--check", action="store_true",
                   help="validate the recipe's flags with the trainer's parser and rules for its world size "
                        "(nnodes x nproc_per_node) and exit: 0 when valid, 2 with the flag and rule otherwise")
    p.add_argument("--nnodes", type=int)
    p.add_argument("--nproc-per-node", type=int)
    p.add_argument("--slurm", metavar="FILE", help="write a SLURM batch script to FILE instead of running")
    return p.parse_intermixed_args(argv)


def main(argv=None) -> int:
    filter_warnings()  # hide the library warnings a user cannot act on
    args = parse_args(argv)
    try:
        recipe = apply_overrides(load_recipe(args.recipe), args.overrides)
        _resolve_paths(recipe, os.getcwd())  # paths given as overrides: relative to this directory
        nnodes, nproc = launch_sizes(recipe, args.nnodes, args.nproc_per_node)
        if args.check:
            print(check_recipe(recipe, nnodes, nproc))
            return 0
        check_world(recipe, nnodes, nproc)
        todo = placeholders(recipe)
        if args.slurm:
            from megatron_csbp.launch.nemo import slurm_job

            # NeMo-Run's job directory (the sbatch and per-rank logs, the job's working directory)
            # beside the script, named after it: run.sbatch -> run_slurm/
            script_path = os.path.abspath(args.slurm)
            job_dir = os.path.splitext(script_path)[0] + "_slurm"
            job = slurm_job(recipe, nnodes, nproc, job_dir)
            if args.dry_run:
                print(job.script)
            else:
                for d in (os.path.dirname(script_path), job.log_dir, job.work_dir):
                    os.makedirs(d, exist_ok=True)  # SLURM writes --output only into an existing directory
                Path(script_path).write_text(job.script)
                print(f"wrote {args.slurm} (logs in {job.log_dir}); submit with: sbatch {args.slurm}")
            for note in requeue_safe(recipe)[1]:
                print(f"warning: {note}", file=sys.stderr)
            if todo:
                print(f"warning: {args.slurm} holds {PLACEHOLDER} placeholders: fill {', '.join(todo)} "
                      f"(as KEY=VALUE overrides or in the recipe) before sbatch", file=sys.stderr)
            return 0
        if nnodes > 1:
            raise RecipeError(f"--nnodes {nnodes}: a multi-node run needs a scheduler; use --slurm FILE "
                              "(or run this command on every node with --rdzv-endpoint)")
        if todo and not args.dry_run:
            raise RecipeError(f"recipe {recipe['name']}: fill the {PLACEHOLDER} placeholders "
                              f"{', '.join(todo)} (KEY=VALUE overrides or in the recipe) before launch")
        cmd = torchrun_command(recipe, nnodes, nproc)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    if args.dry_run:
        if todo:
            print(f"warning: placeholders to fill before launch: {', '.join(todo)}", file=sys.stderr)
        return 0
    from megatron_csbp.launch.nemo import run_local

    return run_local(recipe, nproc)  # NeMo-Run's LocalExecutor runs the same torchrun command


if __name__ == "__main__":
    sys.exit(run(main))
