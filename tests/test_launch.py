"""Recipes and the launcher: generated torchrun commands, overrides, SLURM scripts, clear errors,
and one real local launch of the CPU demo recipe once the trainer exists."""
import glob
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from megatron_csbp.launch.recipes import (
    RecipeError,
    apply_overrides,
    check_world,
    launch_sizes,
    load_recipe,
    main,
    placeholders,
    recipe_flags,
    shipped_recipes,
    torchrun_command,
)

ROOT = os.path.join(os.path.dirname(__file__), "..")
RECIPES = sorted(glob.glob(os.path.join(ROOT, "examples", "recipes", "*.yaml")))
CPU_DEMO = os.path.join(ROOT, "examples", "recipes", "cpu_demo.yaml")
# The launcher runs recipes through NeMo-Run, an optional extra (`pip install megatron-csbp[launch]`,
# installed by requirements/cpu.txt); without it only the tests that do not launch run.
needs_nemo_run = pytest.mark.skipif(importlib.util.find_spec("nemo_run") is None,
                                    reason="nemo-run not installed (pip install megatron-csbp[launch])")


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
    with pytest.raises(RecipeError, match="does not exist; shipped recipes"):
        load_recipe(str(tmp_path / "none.yaml"))
    with pytest.raises(RecipeError, match="not divisible"):
        check_world(load_recipe(CPU_DEMO), 1, 3)
    r = apply_overrides(load_recipe(CPU_DEMO), ["block_parallel_size=3"])
    with pytest.raises(RecipeError, match="multiple of --context-parallel-size"):
        check_world(r, 1, 6)


def _sbatch_paths(text):
    """(#SBATCH options, srun's --output and --chdir) parsed from a NeMo-Run sbatch script."""
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", text, flags=re.M))
    sruns = [shlex.split(line) for line in text.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 1, sruns
    srun = sruns[0]
    return sbatch, srun[srun.index("--output") + 1], srun[srun.index("--chdir") + 1]


@needs_nemo_run
def test_slurm_script(tmp_path, capsys):
    """The sbatch script of NeMo-Run's SlurmExecutor (a dry run, nothing submitted): every path it
    names is the job directory beside the script, exists once the script is written, and the job
    name is the recipe's launch.slurm.job_name exactly."""
    path = os.path.join(ROOT, "examples", "recipes", "nemotron_diffusion_14b_256k_csbp.yaml")
    out = tmp_path / "sub" / "job.sbatch"  # a directory that does not exist yet
    assert main([path, "--slurm", str(out), "training.train_iters=3"]) == 0
    captured = capsys.readouterr()
    # the shipped recipe's placeholders are named, one by one
    assert ("holds REPLACE_ME placeholders: fill data.data_path, objective.mask_token_id, "
            "launch.slurm.partition, launch.slurm.account") in captured.err
    text = out.read_text()
    assert text.startswith("#!/bin/bash") and "Generated by NeMo Run" in text
    sbatch, srun_output, chdir = _sbatch_paths(text)
    name = "nemotron-diffusion-14b-256k-csbp"  # the recipe's launch.slurm.job_name
    assert load_recipe(path)["launch"]["slurm"]["job_name"] == name
    assert sbatch["job-name"] == name
    # <script stem>_slurm/<experiment>/<experiment>_<id>/<task>/ holds the logs; code/ is the work dir
    jobs = str(tmp_path / "sub" / "job_slurm")
    task = os.path.dirname(chdir)
    m = re.fullmatch(re.escape(f"{jobs}/{name}/{name}_") + r"\d+" + re.escape(f"/{name}"), task)
    assert m, task
    assert chdir == f"{task}/code"
    assert sbatch["output"] == f"{task}/sbatch_{name}_%j.out"
    assert srun_output == f"{task}/log-{name}_%j_${{SLURM_RESTART_COUNT:-0}}.out"
    for d in (task, chdir):
        assert os.path.isdir(d), d  # SLURM writes --output only into an existing directory
    # every absolute path in the script is the job directory's, or a flag value of the recipe
    for p in re.findall(r"(?<![\w$])/[\w./%{}:$-]+", text):
        assert p.startswith(jobs + "/") or p in ("/bin/bash", "/data/REPLACE_ME/text_document",
                                                  "/checkpoints/nemotron-diffusion-14b-256k-csbp"), p
    for key, value in {"nodes": "2", "gpus-per-node": "8", "ntasks-per-node": "1", "time": "04:00:00",
                       "cpus-per-task": "64", "exclusive": None, "account": "REPLACE_ME"}.items():
        assert sbatch[key] == (value or ""), key
    # --exit-signal-handler: torchrun that exits 0 once the signalled ranks saved (launch_torchrun)
    for line in ("--kill-on-bad-exit=1 python -m megatron_csbp.launch.torchrun --rdzv-backend c10d "
                 "--rdzv-endpoint $head_node_ip:29500",
                 "--nnodes 2 --nproc-per-node 8", "-m megatron_csbp.train", "--context-parallel-size 8",
                 "--block-parallel-size 8", "--train-iters 3", "export CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert line in text, line
    assert "scontrol show hostnames" in text
    # requeue-enabled (issue 34): the requeued job resumes --save's latest checkpoint, and the SIGTERM of a
    # preemption or the time limit saves first
    assert "sbatch --requeue" in text
    flags = _train_flags(text)
    assert flags["--save"] == flags["--load"] == ["/checkpoints/nemotron-diffusion-14b-256k-csbp"]
    assert flags["--exit-signal-handler"] == []
    assert "warning: --load" not in captured.err
    # the script is valid bash
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


def _train_flags(text):
    """{flag: [values]} of the `-m megatron_csbp.train` command in a NeMo-Run sbatch script."""
    srun = next(shlex.split(line) for line in text.splitlines() if line.startswith("srun "))
    flags, current = {}, None
    for token in srun[srun.index("megatron_csbp.train") + 1:]:
        if token.startswith("--"):
            assert token not in flags, f"{token} given twice"
            current = flags[token] = []
        else:
            current.append(token)
    return flags


@needs_nemo_run
def test_slurm_script_keeps_a_given_load_and_says_what_a_requeue_does(tmp_path, capsys):
    """A recipe that starts from a converted model (--load) keeps it, with one warning line saying a
    requeued job loads it again; an explicit --load equal to --save and an explicit
    `exit_signal_handler: false` stay as written; a recipe without --save gets a warning."""
    qwen = os.path.join(ROOT, "examples", "recipes", "qwen3_27b_256k_csbp.yaml")
    assert main([qwen, "--slurm", str(tmp_path / "q.sbatch")]) == 0
    err = capsys.readouterr().err
    flags = _train_flags((tmp_path / "q.sbatch").read_text())
    assert flags["--load"] == ["/checkpoints/REPLACE_ME/qwen3-27b-megatron"]
    assert flags["--save"] == ["/checkpoints/qwen3-27b-256k-csbp"] and flags["--exit-signal-handler"] == []
    assert ("warning: --load /checkpoints/REPLACE_ME/qwen3-27b-megatron differs from --save "
            "/checkpoints/qwen3-27b-256k-csbp: a requeued job loads /checkpoints/REPLACE_ME/qwen3-27b-megatron "
            "again (set training.load=/checkpoints/qwen3-27b-256k-csbp once /checkpoints/qwen3-27b-256k-csbp "
            "holds a checkpoint)") in err.splitlines()
    save = str(tmp_path / "ck")
    assert main([CPU_DEMO, "--slurm", str(tmp_path / "c.sbatch"), f"training.save={save}",
                 f"training.load={save}", "training.exit_signal_handler=false"]) == 0
    flags = _train_flags((tmp_path / "c.sbatch").read_text())
    assert flags["--save"] == flags["--load"] == [save] and "--exit-signal-handler" not in flags
    assert "--kill-on-bad-exit=1 torchrun --rdzv-backend" in (tmp_path / "c.sbatch").read_text()
    assert "warning: --load" not in capsys.readouterr().err
    assert main([CPU_DEMO, "--slurm", str(tmp_path / "d.sbatch")]) == 0
    assert "warning: recipe cpu-demo sets no --save: a requeued job starts again from iteration 0" in \
        capsys.readouterr().err.splitlines()
    flags = _train_flags((tmp_path / "d.sbatch").read_text())
    assert "--load" not in flags and "--exit-signal-handler" not in flags


@needs_nemo_run
def test_slurm_job_name_and_refused_job_dir(tmp_path, capsys):
    """Without launch.slurm.job_name the job is the recipe's name (NeMo-Run would prefix it with the
    account); a job directory holding '/nemo_run' (which NeMo-Run rewrites in the script) is refused."""
    from megatron_csbp.launch.nemo import slurm_job

    r = apply_overrides(load_recipe(CPU_DEMO), ["launch.slurm.account=acct_x"])
    job = slurm_job(r, 1, 2, str(tmp_path / "jobs"))
    sbatch, _, chdir = _sbatch_paths(job.script)
    assert sbatch["job-name"] == "cpu-demo" and sbatch["account"] == "acct_x"
    assert chdir == job.work_dir and sbatch["output"].startswith(job.log_dir + "/")
    with pytest.raises(RecipeError, match="rewrites the text '/nemo_run'"):
        slurm_job(r, 1, 2, str(tmp_path / "nemo_run_jobs"))


def test_placeholders_named_and_refused_for_a_local_launch(capsys):
    path = os.path.join(ROOT, "examples", "recipes", "qwen3_27b_256k_csbp.yaml")
    assert placeholders(load_recipe(path)) == ["data.data_path", "objective.mask_token_id", "training.load",
                                               "launch.slurm.partition", "launch.slurm.account"]
    assert placeholders(load_recipe(CPU_DEMO)) == []
    # a local launch (one node) with placeholders starts nothing and names them
    one_node = ["--nnodes", "1", "context_parallel_size=4", "block_parallel_size=4"]  # TP 2 x CP 4 = 8
    assert main([path, *one_node]) == 2
    err = capsys.readouterr().err
    assert ("fill the REPLACE_ME placeholders data.data_path, objective.mask_token_id, training.load, "
            "launch.slurm.partition, launch.slurm.account") in err
    assert main([path, *one_node, "--dry-run"]) == 0  # prints the command, warns by name
    assert "placeholders to fill before launch: data.data_path" in capsys.readouterr().err


def test_recipe_paths_are_relative_to_the_recipe(tmp_path, monkeypatch, capsys):
    """A recipe's relative paths mean the same from any directory; an override's are the caller's."""
    path = os.path.join(ROOT, "examples", "recipes", "diffusiongemma_tiny_sft_cpu.yaml")
    monkeypatch.chdir(tmp_path)
    r = load_recipe(path)
    assets = os.path.join(os.path.abspath(ROOT), "megatron_csbp", "data", "assets")
    assert r["data"]["sft_data_path"] == os.path.join(assets, "pydoc_sft.jsonl")
    assert r["data"]["tokenizer_model"] == os.path.join(assets, "pydoc_topics_unigram1024.model")
    assert r["training"]["load"] == "/tmp/csbp-tiny-diffusiongemma/megatron"  # absolute: unchanged
    assert main([path, "--check"]) == 0
    assert "--tokenizer-model" not in capsys.readouterr().out  # found from here: no "not here" note
    # a blend keeps its weights; a hub-style tokenizer name that is not a path stays a name
    p = tmp_path / "r.yaml"
    p.write_text("data: {data_path: ['0.3', a/b, '0.7', /abs/c], tokenizer_model: Org/name}\n")
    r = load_recipe(str(p))
    assert r["data"]["data_path"] == ["0.3", str(tmp_path / "a" / "b"), "0.7", "/abs/c"]
    assert r["data"]["tokenizer_model"] == "Org/name"
    assert main([str(p), "--dry-run", "training.save=ckpt", "--nproc-per-node", "1",
                 "training.tokenizer_type=NullTokenizer"]) == 0
    assert f"--save {tmp_path / 'ckpt'}" in capsys.readouterr().out


def test_unknown_recipe_lists_the_shipped_ones(capsys):
    assert main(["no_such_recipe", "--check"]) == 2
    err = capsys.readouterr().err
    assert "recipe 'no_such_recipe' does not exist; shipped recipes" in err
    for p in RECIPES:
        assert os.path.splitext(os.path.basename(p))[0] in err
    assert shipped_recipes() == sorted(os.path.splitext(os.path.basename(p))[0] for p in RECIPES)
    assert main(["cpu_demo", "--check"]) == 0  # a shipped recipe by its bare name
    assert "recipe cpu-demo: OK for 2 ranks" in capsys.readouterr().out


@needs_nemo_run
def test_recipe_as_nemo_run_tasks():
    import nemo_run as run

    from megatron_csbp.launch.nemo import local_executor, recipe_partial, recipe_script
    from megatron_csbp.training.loop import main as train_main

    r = load_recipe(CPU_DEMO)
    script = recipe_script(r)
    assert isinstance(script, run.Script) and script.m and script.path == "megatron_csbp.train"
    assert script.args == recipe_flags(r) and script.env["OMP_NUM_THREADS"] == "1"
    partial = recipe_partial(r)
    assert isinstance(partial, run.Partial) and partial.__fn_or_cls__ is train_main
    assert partial.argv == recipe_flags(r)
    ex = local_executor(r, 2)
    assert isinstance(ex, run.LocalExecutor) and ex.nproc_per_node() == 2 and ex.launcher == "torchrun"
    # --exit-signal-handler: the local launch runs launch_torchrun itself, the command `launch` prints
    from megatron_csbp.launch.nemo import local_task
    r = apply_overrides(load_recipe(CPU_DEMO), ["training.exit_signal_handler=true"])
    task, ex = local_task(r, 2)
    assert task.path == "megatron_csbp.launch.torchrun" and task.m and ex.launcher is None and ex.ntasks_per_node == 1
    assert [task.entrypoint, "-m", task.path] + task.args == torchrun_command(r, 1, 2)


def test_cli_dry_run_and_errors(capsys):
    assert main([CPU_DEMO, "--dry-run", "training.train_iters=1"]) == 0
    out = capsys.readouterr().out
    assert "torch.distributed.run" in out and "--train-iters 1" in out
    assert main([CPU_DEMO, "--dry-run", "training.exit_signal_handler=true"]) == 0
    assert capsys.readouterr().out.startswith(f"{sys.executable} -m megatron_csbp.launch.torchrun --standalone ")
    assert main([CPU_DEMO, "--dry-run", "--nnodes", "2"]) == 2  # multi-node needs --slurm
    assert "needs a scheduler" in capsys.readouterr().err
    assert main([CPU_DEMO, "--dry-run", "--nproc-per-node", "3"]) == 2


@needs_nemo_run
def test_real_local_launch_of_cpu_demo(tmp_path):
    """The CPU recipe launched for real through NeMo-Run's LocalExecutor (torchrun, 2 gloo ranks)."""
    env = dict(os.environ, NEMORUN_HOME=str(tmp_path / "nemo_run"))
    proc = subprocess.run([sys.executable, "-m", "megatron_csbp.launch", CPU_DEMO, "training.train_iters=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "NeMo-Run: cpu-demo SUCCEEDED" in out
    assert re.search(r"iteration\s+2/\s+2 \|.*lm loss: \S+", out)  # the trainer's own log line, via NeMo-Run
    assert any((tmp_path / "nemo_run" / "experiments").rglob("*"))  # NeMo-Run's experiment record


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_passes_check(path, capsys):
    """`launch RECIPE --check`: the trainer's parser and rules for the recipe's world size."""
    assert main([path, "--check"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    r = load_recipe(path)
    nnodes, nproc = launch_sizes(r, None, None)
    assert f"OK for {nnodes * nproc} ranks" in out
    # every flag is one the trainer takes (the parser refuses the rest); `--objective dflash`
    # hands every flag to `python -m megatron_csbp.dflash train`, whose parser is the trainer's
    from megatron_csbp.training.arguments import build_parser

    parser = build_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    assert {f for f in recipe_flags(r) if f.startswith("--")} <= known


def test_check_refuses_a_bad_dflash_recipe(capsys):
    path = os.path.join(ROOT, "examples", "recipes", "dflash_drafter_512k_csbp.yaml")
    for overrides, message in [(["parallelism.block_parallel_size=3"], "multiple of --context-parallel-size"),
                               (["data.block_size=1"], "--block-size must be >= 2"),
                               (["objective.dflash_loss=mse"], "argument --dflash-loss: invalid choice")]:
        assert main([path, "--check", *overrides]) == 2, overrides
        assert message in capsys.readouterr().err, overrides


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
        (["training.micro_batch_size=0"], "--micro-batch-size must be positive, got 0"),  # was ZeroDivisionError
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


def test_without_nemo_run_the_launcher_names_the_extra(tmp_path, monkeypatch, capsys):
    """`pip install megatron-csbp` without the launch extra: one error line naming it, no traceback;
    --check and --dry-run (no NeMo-Run needed) still work."""
    monkeypatch.setitem(sys.modules, "nemo_run", None)  # `import nemo_run` raises ImportError
    assert main([CPU_DEMO, "--slurm", str(tmp_path / "x.sbatch")]) == 2
    assert "launching recipes needs NeMo-Run: pip install 'megatron-csbp[launch]'" in capsys.readouterr().err
    assert main([CPU_DEMO, "--dry-run"]) == 0


WORKER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))  # as --exit-signal-handler notes it
mode, out = sys.argv[1], sys.argv[2]
tag = os.environ["RANK"] + "." + os.environ["TORCHELASTIC_RESTART_COUNT"]
open(os.path.join(out, "ready" + tag), "w").close()
while not got:
    time.sleep(0.01)
if mode == "fail":
    sys.exit(3)
open(os.path.join(out, "saving" + tag), "w").close()  # "the save": a second SIGTERM comes meanwhile
end = time.time() + 60
while len(got) < 2 and time.time() < end:
    time.sleep(0.01)
open(os.path.join(out, "saved" + tag), "w").close()
"""


def _signal_torchrun(tmp_path, launcher, mode):
    """2 workers of WORKER under `launcher` (with --exit-signal-handler among its arguments), SIGTERM to
    the launcher alone when both run, again when both "save"; (returncode, stderr, files written)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", "1", str(script), mode, str(tmp_path), "--exit-signal-handler"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        for stage in ("ready", "saving") if mode == "save" else ("ready",):
            end = time.time() + 120
            while len(list(tmp_path.glob(stage + "*"))) < 2:
                assert proc.poll() is None and time.time() < end, proc.stderr.read() if proc.poll() is not None else stage
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    return proc.returncode, err, sorted(p.name for p in tmp_path.iterdir() if p.name != "worker.py")


def test_launch_torchrun_forwards_sigterm_and_exits_0(tmp_path):
    """issue 34: SIGTERM to the launcher alone, twice (the second during the "save"): the workers get both,
    finish and exit 0, and so does the launch (torch's torchrun exits 1: next test)."""
    rc, err, files = _signal_torchrun(tmp_path, "megatron_csbp.launch.torchrun", "save")
    assert rc == 0, err[-3000:]
    assert files == ["ready0.0", "ready1.0", "saved0.0", "saved1.0", "saving0.0", "saving1.0"]
    assert err.count("megatron_csbp.launch.torchrun: SIGTERM forwarded to the workers (pids ") == 2, err[-3000:]


def test_torchrun_itself_exits_1_after_its_own_sigterm(tmp_path):
    """Why launch_torchrun exists: torch's agent shuts the same workers down and exits 1."""
    rc, err, _ = _signal_torchrun(tmp_path, "torch.distributed.run", "fail")
    assert rc == 1 and err.rstrip().endswith(f"got signal: {int(signal.SIGTERM)}"), err[-3000:]


def test_launch_torchrun_a_failing_worker_fails_the_launch_without_restart(tmp_path):
    rc, err, files = _signal_torchrun(tmp_path, "megatron_csbp.launch.torchrun", "fail")
    assert rc == 1 and "(forwarded to the workers, which failed: no restart)" in err, err[-3000:]
    assert files == ["ready0.0", "ready1.0"]  # --max-restarts 1, yet no second attempt


def test_launch_torchrun_names_the_torch_api_it_lacks(monkeypatch):
    from megatron_csbp.launch import torchrun as launch_torchrun
    from megatron_csbp.utils.cli import CliError

    monkeypatch.setattr(launch_torchrun, "TORCH_API", launch_torchrun.TORCH_API + (
        ("torch.distributed.elastic.multiprocessing.api", "PContext.no_such_method"),))
    with pytest.raises(CliError, match=r"^--exit-signal-handler: torch \S+ has no torch\.distributed\.elastic\."
                                       r"multiprocessing\.api\.PContext\.no_such_method, which"):
        launch_torchrun.main(["--standalone", "x.py", "--exit-signal-handler"])
