"""Recipes and the launcher: generated torchrun commands, overrides, SLURM scripts, clear errors,
and one real local launch of the CPU demo recipe once the trainer exists."""
import glob
import os
import subprocess
import sys

import pytest

from megatron_csbp.launch import (RecipeError, apply_overrides, check_world, launch_sizes, load_recipe, main,
                                  recipe_flags, slurm_script, torchrun_command)

ROOT = os.path.join(os.path.dirname(__file__), "..")
RECIPES = sorted(glob.glob(os.path.join(ROOT, "examples", "recipes", "*.yaml")))
CPU_DEMO = os.path.join(ROOT, "examples", "recipes", "cpu_demo.yaml")


def test_recipes_exist():
    names = {os.path.basename(p) for p in RECIPES}
    assert "cpu_demo.yaml" in names
    assert len([n for n in names if n.endswith("_256k_csbp.yaml")]) == 5  # the paper's configurations


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_builds_a_valid_command(path):
    r = load_recipe(path)
    nnodes, nproc = launch_sizes(r, None, None)
    world = check_world(r, nnodes, nproc)
    flags = recipe_flags(r)
    for required in ("--seq-length", "--block-size", "--context-parallel-size", "--block-parallel-size",
                     "--objective", "--micro-batch-size", "--global-batch-size"):
        assert required in flags, (path, required)
    names = [f for f in flags if f.startswith("--")]
    assert len(names) == len(set(names))
    assert world == nnodes * nproc


def test_cpu_demo_command():
    r = load_recipe(CPU_DEMO)
    cmd = torchrun_command(r, 1, 2, python="python")
    assert cmd[:4] == ["python", "-m", "torch.distributed.run", "--standalone"]
    i = cmd.index("-m", 3)
    assert cmd[i + 1] == "megatron_csbp.train"
    s = " ".join(cmd)
    assert "--nproc-per-node 2" in s and "--context-parallel-size 2 --block-parallel-size 2" in s
    assert "--group-query-attention" in s  # true -> bare flag
    assert "--attention-transport allgather" in s and "--block-ownership mirrored" in s


def test_overrides():
    r = apply_overrides(load_recipe(CPU_DEMO), ["training.train_iters=7", "block_parallel_size=1",
                                                "data.new_flag=true", "lr=0.5", "launch.nproc_per_node=4"])
    flags = recipe_flags(r)
    assert flags[flags.index("--train-iters") + 1] == "7"
    assert flags[flags.index("--block-parallel-size") + 1] == "1"
    assert flags[flags.index("--lr") + 1] == "0.5"
    assert "--new-flag" in flags
    assert launch_sizes(r, None, None) == (1, 4)
    with pytest.raises(RecipeError, match="no section has"):
        apply_overrides(load_recipe(CPU_DEMO), ["not_a_key=1"])
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        apply_overrides(load_recipe(CPU_DEMO), ["oops"])


def test_bad_recipes(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: {num_layers: 2}\noptimizer: {lr: 1}\n")
    with pytest.raises(RecipeError, match="unknown sections"):
        load_recipe(str(p))
    p.write_text("model: {num_layers: 2}\ntraining: {num_layers: 3}\n")
    with pytest.raises(RecipeError, match="set in both"):
        recipe_flags(load_recipe(str(p)))
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(str(tmp_path / "none.yaml"))
    with pytest.raises(RecipeError, match="not divisible"):
        check_world(load_recipe(CPU_DEMO), 1, 3)
    r = apply_overrides(load_recipe(CPU_DEMO), ["block_parallel_size=3"])
    with pytest.raises(RecipeError, match="multiple of --context-parallel-size"):
        check_world(r, 1, 6)


def test_slurm_script(tmp_path):
    path = os.path.join(ROOT, "examples", "recipes", "nemotron_diffusion_14b_256k_csbp.yaml")
    out = tmp_path / "job.sbatch"
    assert main([path, "--slurm", str(out), "training.train_iters=3"]) == 0
    text = out.read_text()
    assert text.startswith("#!/bin/bash")
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                 "srun --kill-on-bad-exit=1 python -m torch.distributed.run --nnodes 2 --nproc-per-node 8",
                 "--rdzv-endpoint ${MASTER_ADDR}:${MASTER_PORT} --rdzv-id ${SLURM_JOB_ID}",
                 "-m megatron_csbp.train", "--context-parallel-size 8", "--block-parallel-size 8",
                 "--train-iters 3", "export CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert line in text, line
    assert "scontrol show hostnames" in text
    # the script is valid bash
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


def test_cli_dry_run_and_errors(capsys):
    assert main([CPU_DEMO, "--dry-run", "training.train_iters=1"]) == 0
    out = capsys.readouterr().out
    assert "torch.distributed.run" in out and "--train-iters 1" in out
    assert main([CPU_DEMO, "--dry-run", "--nnodes", "2"]) == 2  # multi-node needs --slurm
    assert "needs a scheduler" in capsys.readouterr().err
    assert main([CPU_DEMO, "--dry-run", "--nproc-per-node", "3"]) == 2


def test_real_local_launch_of_cpu_demo():
    if not os.path.exists(os.path.join(ROOT, "megatron_csbp", "train.py")):
        pytest.skip("the trainer (python -m megatron_csbp.train) has not landed yet")
    proc = subprocess.run([sys.executable, "-m", "megatron_csbp.launch", CPU_DEMO, "training.train_iters=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# Flags of the paper recipes that the trainer did not take when the recipes were written (model
# shape and recompute details of Megatron-LM). The CPU demo must use none; the paper recipes may
# use only these until the trainer grows them (then this set only shrinks).
PENDING_TRAINER_FLAGS = {
    "--kv-channels", "--disable-bias-linear", "--position-embedding-type", "--attention-dropout",
    "--hidden-dropout", "--recompute-method", "--recompute-num-layers", "--attention-backend",
    "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--window-size", "--window-attn-skip-freq",
    "--moe-token-dispatcher-type",
}


def _trainer_options():
    try:
        from megatron_csbp.training.arguments import build_parser
    except ImportError:
        pytest.skip("the trainer's argument parser (megatron_csbp.training.arguments) has not landed")
    return {s for a in build_parser()._actions for s in a.option_strings}


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_flags_known_to_the_trainer(path):
    known = _trainer_options()
    recipe = load_recipe(path)
    if recipe["objective"].get("objective") == "dflash":
        # `megatron_csbp.train --objective dflash` hands every flag to `megatron_csbp.dflash train`
        from megatron_csbp.dflash import train_parser

        known = {s for a in train_parser()._actions for s in a.option_strings}
    unknown = {f for f in recipe_flags(recipe) if f.startswith("--")} - known
    if os.path.basename(path) == "cpu_demo.yaml" or os.path.basename(path).startswith(("diffusiongemma_", "dflash_")):
        assert not unknown, unknown
    else:
        assert unknown <= PENDING_TRAINER_FLAGS, sorted(unknown - PENDING_TRAINER_FLAGS)
