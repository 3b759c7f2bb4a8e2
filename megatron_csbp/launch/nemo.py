"""Recipes as NeMo-Run tasks (PyPI `nemo-run`, which imports with `leptonai<0.27`).

`recipe_script` / `recipe_partial` (a `run.Script` / `run.Partial` of the trainer) with
`local_executor` (torchrun here) or `slurm_executor` (`slurm_job` returns its sbatch script from
a dry run, nothing submitted). Usage from Python: docs/recipes.md#local-runs-and-slurm-through-nemo-run.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Dict, NamedTuple, Optional

from megatron_csbp.compat import swapped
from megatron_csbp.launch.recipes import CHECKOUT, TORCHRUN, RecipeError, _flag, recipe_flags, torchrun_command


def _run():
    try:
        import nemo_run as run
    except ImportError as e:  # pragma: no cover - requirements/cpu.txt installs it
        raise RecipeError("launching recipes needs NeMo-Run: pip install 'megatron-csbp[launch]' (nemo-run and "
                          f"leptonai<0.27; requirements/cpu.txt has them): {e}") from e
    return run


def recipe_env(recipe: Dict) -> Dict[str, str]:
    return {str(k): str(v) for k, v in (recipe["launch"].get("env") or {}).items()}


def recipe_script(recipe: Dict, python: str = sys.executable):
    """`python -m megatron_csbp.train FLAGS` as a NeMo-Run Script (torchrun wraps it per executor)."""
    return _run().Script(path="megatron_csbp.train", args=recipe_flags(recipe), entrypoint=python, m=True,
                         env=recipe_env(recipe))


def recipe_partial(recipe: Dict):
    """`megatron_csbp.training.loop.main(argv=FLAGS)` as a NeMo-Run Partial."""
    from megatron_csbp.training.loop import main

    return _run().Partial(main, argv=recipe_flags(recipe))


def local_executor(recipe: Dict, nproc: int):
    env = recipe_env(recipe)
    # Spawned ranks import this checkout first, as `python -m megatron_csbp.launch` itself does.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CHECKOUT, os.environ.get("PYTHONPATH", "")) if p)
    return _run().LocalExecutor(ntasks_per_node=nproc, nodes=1, launcher="torchrun", env_vars=env)


def slurm_executor(recipe: Dict, nnodes: int, nproc: int, job_dir: str):
    """SLURM through NeMo-Run: `launch.slurm` keys map to SlurmExecutor fields (`job_name`,
    `partition`, `account`, `time`, `cpus_per_task`, `container_image`, `container_mounts`,
    `exclusive` (default true), `extra_sbatch` ("--key=value" lines), `setup` (shell lines));
    `output` is NeMo-Run's own (the job directory's sbatch_*.out and log-*.out)."""
    run = _run()
    sl = dict(recipe["launch"].get("slurm") or {})
    sbatch = (str(line).lstrip("-").partition("=") for line in sl.get("extra_sbatch") or [])  # "--key=value"
    extra = {key.replace("-", "_"): value or None for key, _, value in sbatch}
    mounts = sl.get("container_mounts")
    if isinstance(mounts, str):
        mounts = [m for m in mounts.split(",") if m]
    env = recipe_env(recipe)
    env.setdefault("MASTER_PORT", str(recipe["launch"].get("master_port") or 29500))
    return run.SlurmExecutor(
        account=sl.get("account") or "", partition=sl.get("partition"), time=sl.get("time") or "",
        nodes=nnodes, ntasks_per_node=nproc, gpus_per_node=nproc, cpus_per_task=sl.get("cpus_per_task"),
        exclusive=sl.get("exclusive", True), container_image=sl.get("container_image"),
        container_mounts=list(mounts or []), additional_parameters=extra, setup_lines="\n".join(sl.get("setup") or []),
        env_vars=env, job_name_prefix="", launcher="torchrun",
        packager=run.Packager(),  # the cluster has megatron_csbp installed (or in the container)
        tunnel=run.LocalTunnel(job_dir=job_dir))


class SlurmJob(NamedTuple):
    script: str  #: the sbatch script
    log_dir: str  #: where SLURM writes `#SBATCH --output` and srun's per-node logs
    work_dir: str  #: srun's `--chdir` (NeMo-Run's `code` directory of the job)


def slurm_job(recipe: Dict, nnodes: int, nproc: int, job_dir: Optional[str] = None) -> SlurmJob:
    """The sbatch script NeMo-Run's SlurmExecutor would submit (a dry run: nothing is submitted or
    created), with the directories it names. The script is requeue-enabled (`sbatch --requeue`), so
    the recipe runs as `launch.requeue_safe` makes it: `--load` = `--save` unless the recipe sets
    `--load`, and `--exit-signal-handler` (a preempted job saves, the requeued one resumes). The job
    is named `launch.slurm.job_name` (else the recipe's name) exactly: NeMo-Run would otherwise
    prefix it with `<account>-<account suffix>.`."""
    run = _run()
    from nemo_run.config import RUNDIR_NAME
    from nemo_run.core.execution.slurm import SlurmJobDetails

    from megatron_csbp.launch.recipes import requeue_safe

    recipe = requeue_safe(recipe)[0]  # the script is requeue-enabled: --load = --save, --exit-signal-handler

    job_dir = os.path.abspath(job_dir or os.path.join(os.getcwd(), "slurm_jobs"))
    if f"/{RUNDIR_NAME}" in job_dir:
        # NeMo-Run (0.11) rewrites every "/nemo_run" in a container-less script to the job directory
        raise RecipeError(f"SLURM job directory {job_dir}: NeMo-Run rewrites the text '/{RUNDIR_NAME}' in "
                          "the script; write the script under a path without it")
    sl = recipe["launch"].get("slurm") or {}
    name = str(sl.get("job_name") or recipe["name"])
    executor = slurm_executor(recipe, nnodes, nproc, job_dir)
    executor.job_details = SlurmJobDetails(job_name=name)
    # NeMo-Run's LocalTunnel runs its shell commands through invoke, which mirrors stdin: a dry run
    # reads nothing, so give it an empty one (a closed or captured stdin would make it fail).
    with open(os.devnull) as devnull, swapped(sys, "stdin", devnull):
        with run.Experiment(recipe["name"], executor=executor, log_level="ERROR") as exp:
            exp.add(recipe_script(recipe, python="python"), name=name)
            exp.dryrun(log=False)
            script = exp.jobs[0]._dryrun_info.request.materialize()
            task_executor = exp.jobs[0].executor
    # the directory NeMo-Run's script names for this task: <job_dir>/<experiment>/<experiment id>/<task>
    task_dir = os.path.join(task_executor.tunnel.job_dir, os.path.basename(task_executor.job_dir))
    if _flag(recipe, "exit_signal_handler"):  # torchrun exits 1 after a SIGTERM; launch_torchrun 0
        script, n = re.subn(r"^(srun .*?) torchrun ", rf"\1 python -m {TORCHRUN} ", script, count=1, flags=re.M)
        if n != 1:
            raise RecipeError(f"NeMo-Run's sbatch script has no `srun ... torchrun` line to run {TORCHRUN} in")
    return SlurmJob(script, str(task_executor.job_details.folder), os.path.join(task_dir, "code"))


def local_task(recipe: Dict, nproc: int):
    """(task, executor) of a local launch: `recipe_script` under the LocalExecutor's torchrun, or for an
    `--exit-signal-handler` recipe the command `launch` prints, `python -m megatron_csbp.launch.torchrun
    ... -m megatron_csbp.train ...`, as one task (torchrun would exit 1 after a SIGTERM)."""
    task, executor = recipe_script(recipe), local_executor(recipe, nproc)
    if _flag(recipe, "exit_signal_handler"):
        cmd = torchrun_command(recipe, 1, nproc)
        task = _run().Script(path=TORCHRUN, args=cmd[3:], entrypoint=cmd[0], m=True, env=recipe_env(recipe))
        executor.ntasks_per_node, executor.launcher = 1, None
    return task, executor


def run_local(recipe: Dict, nproc: int) -> int:
    """Run the recipe on this machine with NeMo-Run's LocalExecutor (torchrun); 0 on success."""
    run = _run()
    # NeMo-Run's LocalExecutor runs the `torchrun` it finds on PATH: put the one installed beside this
    # interpreter first, so the ranks run in the environment launch runs in (a venv not activated)
    here, path = os.path.dirname(sys.executable), os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != here:  # once per process, however many launches it makes
        os.environ["PATH"] = here + os.pathsep + path
    task, executor = local_task(recipe, nproc)
    with run.Experiment(recipe["name"], executor=executor, log_level="WARN") as exp:
        exp.add(task, name=recipe["name"], tail_logs=True)
        exp.run(detach=False)
    # Leaving the experiment waits for its jobs; their states are final then.
    states = [str(job.state) for job in exp.jobs]
    print(f"NeMo-Run: {recipe['name']} {', '.join(states)}", flush=True)
    return 0 if states and all(s.endswith("SUCCEEDED") for s in states) else 1
