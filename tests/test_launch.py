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
    proc = subprocess.run([sys.executable, "-m", "megatron_csbp.launch", CPU_DEMO, "training.train_iters=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_passes_check(path, capsys):
    """`launch RECIPE --check`: the trainer's parser and rules for the recipe's world size."""
    assert main([path, "--check"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    r = load_recipe(path)
    nnodes, nproc = launch_sizes(r, None, None)
    assert f"OK for {nnodes * nproc} ranks" in out
    # every flag is one the trainer takes (the parser refuses the rest)
    from megatron_csbp.training.arguments import build_parser

    known = {s for a in build_parser()._actions for s in a.option_strings}
    assert {f for f in recipe_flags(r) if f.startswith("--")} <= known


def test_check_names_the_flag_and_the_rule(capsys):
    path = os.path.join(ROOT, "examples", "recipes", "nemotron_diffusion_14b_256k_csbp.yaml")
    cases = [
        (["model.recompute_sideways=1"], "does not take: --recompute-sideways"),
        (["objective.objective=fast_dllm_v2"], "argument --objective: invalid choice"),
        (["data.block_size=300"], "--block-size 300 does not divide --seq-length 262144"),
        (["block_parallel_size=3"], "multiple of --context-parallel-size"),
        (["training.recompute_granularity=selective"], "--recompute-method uniform needs --recompute-granularity full"),
        (["training.attention_backend=flash", "parallelism.attention_kernel=math"], "--attention-backend flash"),
        (["model.attention_dropout=0.1"], "--attention-dropout must be 0"),
        (["training.global_batch_size=3"], "--global-batch-size 3 must be a multiple"),
    ]
    for overrides, message in cases:
        assert main([path, "--check", *overrides]) == 2, overrides
        err = capsys.readouterr().err
        assert message in err, (overrides, err)
    # the world size is the recipe's (2 x 8): 12 ranks do not tile CP 8
    assert main([path, "--check", "--nproc-per-node", "6"]) == 2
    assert "not divisible" in capsys.readouterr().err
    # the CLI exits 2 with the message, and starts nothing
    proc = subprocess.run([sys.executable, "-m", "megatron_csbp.launch", path, "--check", "data.block_size=300"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--block-size 300" in proc.stderr, proc.stderr[-2000:]
