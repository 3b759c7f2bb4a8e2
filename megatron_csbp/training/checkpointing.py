"""Checkpoints through `megatron.core.dist_checkpointing` (torch_dist), written atomically.

Layout of `--save DIR` (Megatron-LM's names):

    DIR/latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint
    DIR/iter_0000100/                       a complete dist_checkpointing directory
    DIR/iter_0000200.tmp-<nonce>/           a save in progress (ignored, removed by the next save)

A save writes everything into a fresh temporary directory, then (rank 0, after every rank finished)
renames it to `iter_N` and replaces the tracker file with `os.replace`. A crash at any point leaves
the tracker pointing at the previous complete checkpoint. Loading reads the tracker.

State: the model as Megatron's GPT sharded state dict (plain GPT keys), the optimizer with
`fully_reshardable` sharding for the distributed optimizer (so TP, CP, BP and DP may all change
between save and load), the LR scheduler, iteration and consumed samples. Training noise is keyed
by (seed, sample index) and dropout is off, so this is everything an exact resume needs.

Converted models (`python -m megatron_csbp.convert hf-to-megatron`): the tracker holds `release`
and `DIR/release/` holds the model only; it is loaded as weights (iteration 0, no optimizer or
scheduler state). The model shape comes from `megatron_csbp_model.json` (`checkpoint_shape`), and
every checkpoint saved from such a model carries that file (in `iter_N/` and the root) and the
root's `hf_assets/`, so `convert megatron-to-hf` / `score` read trained checkpoints.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from megatron_csbp.model.checkpoint import (  # noqa: F401  (the format's names, re-exported)
    ASSETS_DIR, META_FILE, RELEASE, SHAPE_FILE, TRACKER, checkpoint_path, iteration_dir, read_checkpoint_model,
    read_tracker,
)

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def checkpoint_shape(root: Optional[str], iteration=None):
    """The `ModelShape` of a converted model's checkpoint `--load root` would load (its
    `megatron_csbp_model.json`), or None (no checkpoint, or a flag-built one: the model is built
    from the flags). `megatron_csbp.model.checkpoint.read_checkpoint_model` reads it."""
    if not root or not os.path.isdir(root):
        return None
    if iteration is None and read_tracker(root) is None:
        return None  # nothing saved yet
    try:
        return read_checkpoint_model(root, iteration).file_shape
    except FileNotFoundError as exc:  # a tracker naming a missing or incomplete checkpoint
        raise ValueError(str(exc)) from None


def _sharded_state(model, optimizer, is_loading: bool) -> Dict[str, Any]:
    state = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    return state


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, consumed_samples: int,
                    extra: Optional[Dict[str, Any]] = None, _fail_after_write: bool = False,
                    shape=None, assets_from: Optional[str] = None) -> str:
    """Collective. Returns the final directory. `_fail_after_write` simulates a crash (tests).
    `shape` (a ModelShape): written as `megatron_csbp_model.json` into the iteration folder and
    `root`; `assets_from` (an `hf_assets/` folder): copied to `root/hf_assets` if absent there."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = iteration_dir(root, iteration)
    nonce = [uuid.uuid4().hex[:8] if rank == 0 else None]
    dist.broadcast_object_list(nonce, src=0)
    tmp = f"{final}.tmp-{nonce[0]}"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of crashed saves
            if ".tmp-" in name:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state["iteration"] = iteration
    state["consumed_samples"] = consumed_samples
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["extra"] = extra or {}
    dist_checkpointing.save(state, tmp)
    dist.barrier()
    if _fail_after_write:
        raise RuntimeError("simulated crash during checkpoint save")
    if rank == 0:
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump({"iteration": iteration, "consumed_samples": consumed_samples, **(extra or {})}, f, indent=1)
        if shape is not None:
            with open(os.path.join(tmp, SHAPE_FILE), "w") as f:
                f.write(shape.to_json())
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving the same iteration: move the old one aside first
            old = f"{final}.old-{nonce[0]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        tracker_tmp = os.path.join(root, f".{TRACKER}.{nonce[0]}")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
        if shape is not None:
            shape_tmp = os.path.join(root, f".{SHAPE_FILE}.{nonce[0]}")
            with open(shape_tmp, "w") as f:
                f.write(shape.to_json())
            os.replace(shape_tmp, os.path.join(root, SHAPE_FILE))
        dst = os.path.join(root, ASSETS_DIR)
        if assets_from and os.path.isdir(assets_from) and not os.path.exists(dst) \
                and os.path.abspath(assets_from) != os.path.abspath(dst):
            shutil.copytree(assets_from, dst)
        _fsync_dir(root)
    dist.barrier()
    return final


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


def load_checkpoint(root: str, model, optimizer, scheduler, iteration: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """Collective. Loads the tracker's checkpoint (or `iteration`); None when there is none.
    A `release` checkpoint (converted model) loads the model only: iteration 0, consumed samples 0,
    fresh optimizer and scheduler."""
    from megatron.core import dist_checkpointing

    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            return None
    path = checkpoint_path(root, iteration)
    if not os.path.isdir(path):
        raise ValueError(f"--load {root}: checkpoint directory {path} is missing")
    if iteration == RELEASE:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        _load_model_state(model, loaded["model"], path)
        if optimizer is not None:  # mixed-precision main params were copied from unloaded weights
            optimizer.reload_model_params()
        return {"iteration": 0, "consumed_samples": 0, "extra": {}, "path": path, "release": True}
    state = _sharded_state(model, optimizer, is_loading=True)
    loaded = dist_checkpointing.load(state, path)
    _load_model_state(model, loaded["model"], path)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    return {"iteration": int(loaded["iteration"]), "consumed_samples": int(loaded["consumed_samples"]),
            "extra": loaded.get("extra", {}), "path": path}


def _load_model_state(model, state, path: str) -> None:
    missing, unexpected = model.gpt.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"checkpoint {path} lacks model keys {missing[:5]}")


def load_model_only(root: str, model) -> Dict[str, Any]:
    """Weights only (generation): any layout, no optimizer."""
    return load_checkpoint(root, model, None, None)
