"""The trainer's state through `megatron.core.dist_checkpointing` (torch_dist), written atomically in
Megatron-LM's layout (`checkpoint.files`): a fresh `DIR/iter_N.tmp-<nonce>/`, renamed by rank 0
once every rank finished, then the tracker replaced with `os.replace`. What is saved, converted
models and refusals: docs/training.md#checkpoints.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import queue
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_csbp.checkpoint.files import (
    ASSETS_DIR, META_FILE, RELEASE, SHAPE_FILE, TRACKER, CheckpointError, checkpoint_path, checkpoint_to_load,
    first_existing, iteration_dir,
)
from megatron_csbp.checkpoint.integrity import check_checkpoint_files, write_checksums
from megatron_csbp.compat import swapped
from megatron_csbp.utils.cli import CliError

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def check_finite(model, iteration: int) -> None:
    """Collective: refuse to save weights with a NaN or infinity on any rank (the previous
    checkpoint stays the latest)."""
    bad = any(not torch.isfinite(p.detach()).all() for p in model.parameters())
    flag = torch.tensor([float(bad)], device=next(model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise CheckpointError(f"iteration {iteration}: the weights hold NaN or infinite values; not saving a "
                              "checkpoint (the last one saved stays the latest)")


#: which model state-dict keys a checkpoint holds (a LoRA run's: its adapters); None: every key
Keep = Optional[Callable[[str], bool]]


def _sharded_state(model, optimizer, is_loading: bool, keep: Keep = None) -> Dict[str, Any]:
    from megatron_csbp.parallel.pipeline import sharded_state

    state = sharded_state(model)  # {"model": ...}; interleaved pipeline chunks: {"model0": ..., "model1": ...}
    if keep is not None:  # (the optimizer's parameters are among the kept: it maps them by these)
        state = {k: {n: t for n, t in chunk.items() if keep(n)} for k, chunk in state.items()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    return state


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_results_in_process():
    """While active, megatron-core's torch_dist writer hands its write results back through a queue
    of this process instead of a `multiprocessing.Manager` queue.

    The writer (`strategies/filesystem_async.py`, megatron-core 0.16 and 0.19: module global
    `_results_queue`) makes that Manager queue on its first save and keeps it: a server process
    started with the spawn method, whose SIGTERM disposition is the default (it does not run this
    process's `--exit-signal-handler`). A SIGTERM to every process of the job (Slurm at preemption
    or the time limit) or to the rank's process group (what torchrun sends its workers) kills that
    server, and the next save dies with BrokenPipeError, leaving `iter_N.tmp-*` behind. A synchronous
    save produces and consumes the results in this very process, so a plain `queue.Queue` carries
    them with no helper process that a signal could kill. (A version without the global: the
    writer's own queue, unchanged.)"""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        return contextlib.nullcontext()
    return swapped(filesystem_async, "_results_queue", queue.Queue())


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, consumed_samples: int,
                    extra: Optional[Dict[str, Any]] = None, _fail_after_write: bool = False,
                    shape=None, assets_from: Optional[str] = None, keep: Keep = None,
                    files: Optional[Dict[str, str]] = None) -> str:
    """Collective. Returns the final directory. `_fail_after_write` simulates a crash (tests).
    `shape` (a ModelShape): written as `megatron_csbp_model.json` into the iteration folder and
    `root`; `assets_from` (an `hf_assets/` folder): copied to `root/hf_assets` if absent there.
    `keep`: the model keys saved (all when None); `files`: {name: text} written into the iteration
    folder (before its checksums)."""
    from megatron.core import dist_checkpointing

    check_finite(model, iteration)
    rank = dist.get_rank()
    final = iteration_dir(root, iteration)
    nonce = [uuid.uuid4().hex[:8] if rank == 0 else None]
    dist.broadcast_object_list(nonce, src=0)
    tmp = f"{final}.tmp-{nonce[0]}"
    shape_file = {SHAPE_FILE: shape.to_json()} if shape is not None else {}
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for leftover in glob.glob(os.path.join(glob.escape(root), "*.tmp-*")):  # of crashed saves
            shutil.rmtree(leftover, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False, keep=keep)
    state.update(iteration=iteration, consumed_samples=consumed_samples, extra=extra or {},
                 scheduler=scheduler.state_dict() if scheduler is not None else None)
    with write_results_in_process():  # synchronous: nothing a SIGTERM to the job could kill mid-save
        dist_checkpointing.save(state, tmp)
    dist.barrier()
    if _fail_after_write:
        raise RuntimeError("simulated crash during checkpoint save")
    if rank == 0:
        meta = json.dumps({"iteration": iteration, "consumed_samples": consumed_samples, **(extra or {})}, indent=1)
        for name, text in {META_FILE: meta, **shape_file, **(files or {})}.items():
            Path(tmp, name).write_text(text)
    dist.barrier()
    write_checksums(tmp)  # every file, checked before every load
    if rank == 0:
        _fsync_dir(tmp)
        old = f"{final}.old-{nonce[0]}"
        if os.path.exists(final):  # re-saving the same iteration: move the old one aside first
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(root)
        for name, text in {TRACKER: str(iteration), **shape_file}.items():  # each replaced atomically
            part = os.path.join(root, f".{name}.{nonce[0]}")
            with open(part, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, os.path.join(root, name))
        dst = os.path.join(root, ASSETS_DIR)
        if assets_from and os.path.isdir(assets_from) and not os.path.exists(dst) \
                and os.path.abspath(assets_from) != os.path.abspath(dst):
            shutil.copytree(assets_from, dst)
        _fsync_dir(root)
    dist.barrier()
    return final


def failed_save(root: str, iteration: int, exc: BaseException, logged: Sequence[str] = ()) -> str:
    """After a save of `iteration` into `root` failed with `exc` on this rank: its leftover
    `iter_N.tmp-*` removed (rank 0), and the cause in words with the space left there: the first
    OSError in the chain or in torch's per-rank failures, else an `[Errno N]` or a short write in
    their texts or in the error lines the writer `logged` (megatron-core 0.19 keeps the errno only
    there), else the exception's last line."""
    if dist.get_rank() == 0:
        for leftover in glob.glob(glob.escape(iteration_dir(root, iteration)) + ".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    chain, todo = [], [exc]
    while todo:
        e = todo.pop(0)
        if isinstance(e, BaseException) and all(e is not c for c in chain):
            chain.append(e)
            for w in getattr(e, "failures", {}).values():  # torch's per rank: (exception, traceback)
                todo.append(w[0] if isinstance(w, tuple) else getattr(w, "exception", w))
            todo += [e.__cause__, e.__context__]
    errors = [e for e in chain if isinstance(e, OSError) and e.errno]
    texts = [f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:300]}" for e in chain[1:] + chain[:1]]
    lines = "\n".join(texts + list(logged))
    # (the first line that has one; torch's zip writer after a short write)
    errno, short = re.search(r"\[Errno (\d+)\]", lines), re.search(r"unexpected pos \d+ vs \d+", lines)
    if errors:
        cause = os.strerror(errors[0].errno) + (f" ({errors[0].filename})" if errors[0].filename else "")
    elif errno:
        cause = os.strerror(int(errno.group(1)))
    elif short:
        cause = f"a file write was cut short (a full disk, or a file-size limit): torch's zip writer: {short.group(0)}"
    else:
        cause = texts[0]
    with contextlib.suppress(OSError):
        cause += f" ({shutil.disk_usage(first_existing(root)).free / 2**20:.1f} MiB free there)"
    return cause


def drop_unretained(root: str, previous, iteration: int, retain_interval: int) -> Optional[str]:
    """Megatron-LM's --save-retain-interval, after the save of `iteration` (rank 0): the previous
    checkpoint (the tracker's before that save) is deleted unless it is at a multiple of
    `retain_interval` (or is a release, or a symbolic link). Returns the deleted folder, or None."""
    if not isinstance(previous, int) or previous <= 0 or previous == iteration or previous % retain_interval == 0:
        return None
    path = iteration_dir(root, previous)
    if os.path.islink(path) or not os.path.isdir(path):
        return None
    shutil.rmtree(path)
    return path


def load_checkpoint(root: str, model, optimizer, scheduler, iteration: Optional[int] = None,
                    keep: Keep = None) -> Optional[Dict[str, Any]]:
    """Collective. Loads the tracker's checkpoint (or `iteration`); None when there is none.
    A `release` checkpoint (converted model) loads the model only: iteration 0, consumed samples 0,
    fresh optimizer and scheduler. `keep`: the model keys read (the others keep their values)."""
    from megatron.core import dist_checkpointing

    iteration = checkpoint_to_load(root, iteration)
    if iteration is None:
        return None
    path = checkpoint_path(root, iteration)
    check_checkpoint_files(path)
    release = iteration == RELEASE
    loaded = _read(dist_checkpointing, _sharded_state(model, None if release else optimizer, True, keep), path)
    _load_model_state(model, loaded, path, keep)
    if release:
        if optimizer is not None:  # mixed-precision main params were copied from unloaded weights
            optimizer.reload_model_params()
        return {"iteration": 0, "consumed_samples": 0, "extra": {}, "path": path, "release": True}
    check_resumed_schedule(scheduler, loaded.get("scheduler"), path)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    return {"iteration": int(loaded["iteration"]), "consumed_samples": int(loaded["consumed_samples"]),
            "extra": loaded.get("extra", {}), "path": path}


# ---- a resume with other learning-rate or schedule flags ----------------------------------------
#
# The trainer steps megatron-core's optimizer and OptimizerParamScheduler with Megatron-LM's flags
# `--override-opt_param-scheduler` / `--use-checkpoint-opt_param-scheduler`, so a resume whose flags
# changed the schedule does what Megatron-LM's `pretrain()` does on the same megatron-core:
#
# - neither flag: every scheduler value must equal the checkpoint's (megatron-core asserts; here one
#   line names the flags that changed);
# - --use-checkpoint-opt_param-scheduler: the checkpoint's values win;
# - --override-opt_param-scheduler: the flags' values win for the scheduler (decay style, warmup,
#   decay steps, weight decay), while each learning rate is computed from the optimizer's parameter
#   groups' `max_lr` / `min_lr`, which the optimizer's own state restores: on megatron-core 0.16.1 the
#   checkpoint's (the new --lr / --min-lr do not reach the learning rate, as in Megatron-LM
#   core_v0.16.1; a line says so);
# - megatron-core 0.19 also matches the optimizer's parameter groups by `max_lr` / `min_lr`
#   (`param_group_identifier_keys`), so a changed --lr or --min-lr cannot be loaded at all, with either
#   flag (Megatron-LM core_v0.19.0 stops with "Could not find parameter group"): refused in one line.

#: OptimizerParamScheduler.state_dict() entries and the trainer flags that set them
SCHEDULER_FLAGS = {
    "max_lr": "--lr", "min_lr": "--min-lr", "lr_decay_style": "--lr-decay-style",
    "lr_warmup_steps": "--lr-warmup-iters/--lr-warmup-fraction (x --global-batch-size samples)",
    "lr_decay_steps": "--lr-decay-iters, default --train-iters (x --global-batch-size samples)",
    "start_wd": "--weight-decay", "end_wd": "--weight-decay",
    "wd_incr_steps": "--lr-decay-iters, default --train-iters (x --global-batch-size samples)",
    "wd_incr_style": "the weight-decay schedule",
}


def param_groups_keyed_by_lr() -> bool:
    """Whether megatron-core's optimizer matches saved parameter groups by their max_lr/min_lr
    (megatron-core 0.19: optimizer.py `param_group_identifier_keys`; 0.16.1: by wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr only)."""
    from megatron.core.optimizer import optimizer as core_optimizer

    return "max_lr" in getattr(core_optimizer, "param_group_identifier_keys", ())


def check_resumed_schedule(scheduler, saved: Optional[Dict[str, Any]], path: str) -> None:
    """Before the optimizer and scheduler state are loaded: refuse, in one line naming the flags, a
    resume that Megatron-LM would stop with an assertion or a parameter-group error (see above)."""
    if scheduler is None or saved is None:
        return
    now = scheduler.state_dict()
    lr_changed = [f"{SCHEDULER_FLAGS[k]} {now[k]} (the checkpoint's {saved[k]})" for k in ("max_lr", "min_lr")
                  if k in saved and now[k] != saved[k]]
    if lr_changed and param_groups_keyed_by_lr():
        import megatron.core

        raise CheckpointError(
            f"cannot resume {path} with {' and '.join(lr_changed)}: megatron-core {megatron.core.__version__} matches "
            "the optimizer's parameter groups by their max_lr/min_lr, so it cannot load the checkpoint's under "
            "another --lr or --min-lr, whatever --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler "
            "say (Megatron-LM fails the same way); resume with the checkpoint's --lr and --min-lr")
    override = getattr(scheduler, "override_opt_param_scheduler", False)
    use_checkpoint = getattr(scheduler, "use_checkpoint_opt_param_scheduler", False)
    if not (override or use_checkpoint):
        changes = {}  # one line per flag: its first changed value
        for key, flag in SCHEDULER_FLAGS.items():
            if key in saved and key in now and now[key] != saved[key]:
                changes.setdefault(flag, f"{flag} gives {key} {now[key]}, the checkpoint's is {saved[key]}")
        if changes:
            raise CheckpointError(
                f"cannot resume {path}: {'; '.join(changes.values())}. Pass --use-checkpoint-opt_param-scheduler (keep "
                "the checkpoint's schedule) or --override-opt_param-scheduler (take the flags'), or resume with the "
                "checkpoint's values (Megatron-LM's rule)")
    elif override and lr_changed and dist.get_rank() == 0:
        print(f" --override-opt_param-scheduler: the schedule follows the flags, but {' and '.join(lr_changed)} "
              "does not reach the learning rate: the optimizer's parameter groups keep the checkpoint's max_lr/min_lr "
              "(megatron-core's OptimizerParamScheduler reads them; Megatron-LM does the same)", flush=True)


def _read(dist_checkpointing, state, path: str):
    """dist_checkpointing.load, with a failure to read named by the checkpoint folder (only this
    rank may have failed: not agreed). Damaged bytes can raise any exception while unpickled."""
    try:
        return dist_checkpointing.load(state, path)
    except CliError:
        raise
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}".strip()
        if "weights_only" in text:  # torch's advice to unpickle anything: a pickled part is garbage
            text = f"{type(exc).__name__}: a pickled part is corrupt"
        raise CheckpointError(f"cannot load checkpoint {path}: {text.splitlines()[0]}", agreed=False) from exc


def _load_model_state(model, loaded, path: str, keep: Keep = None) -> None:
    from megatron_csbp.parallel.pipeline import keyed_chunks

    for key, chunk in keyed_chunks(model).items():  # a model chunk (its `gpt`), or a bare model (generation's)
        missing, _ = getattr(chunk, "gpt", chunk).load_state_dict(loaded[key], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state") and (keep is None or keep(k))]
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks model keys {missing[:5]}")

