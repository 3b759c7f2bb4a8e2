"""Megatron `torch_dist` checkpoints of converted models (see docs/conversion.md for the format).

    OUT/
      latest_checkpointed_iteration.txt   "release" (Megatron-LM's marker for a converted model)
      megatron_csbp_model.json            the model shape (ModelShape), incl. the source HF config
      hf_assets/                          tokenizer / generation files of the source model
      release/                            dist_checkpointing torch_dist checkpoint:
        {"model": GPTModel.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 0}
        megatron_csbp_model.json          (copy, so the iteration folder is self-contained)

The sharded state dict of the unsharded (TP = PP = EP = 1) model is saved; dist_checkpointing
reshards it on load, so the trainer loads it under any TP / CP / BP / EP layout, and
`load_gpt_model` reads back a checkpoint the trainer saved under any layout (a flag-built one too:
`megatron_csbp.model.checkpoint` derives its shape from the saved flags).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Optional, Union

import torch
import torch.distributed as dist

from megatron_csbp.compat.cpu import install_cpu_compat
from megatron_csbp.model.checkpoint import ASSETS_DIR, MODEL_KEY, RELEASE, TRACKER as TRACKER_FILE, CheckpointModel
from megatron_csbp.model.checkpoint import load_checkpoint_model, load_model_weights  # noqa: F401  (re-exported)
from megatron_csbp.model.families import SHAPE_FILE, ModelShape

CHECKPOINT_VERSION = 3.0


@contextlib.contextmanager
def single_process_megatron():
    """A one-rank gloo group and Megatron's parallel state (TP = PP = 1), unless the caller already
    set them up; torn down afterwards if created here."""
    from megatron.core import parallel_state as mpu

    install_cpu_compat()  # a no-op with CUDA
    created_pg = created_mpu = False
    tmp = None
    if not dist.is_initialized():
        tmp = tempfile.mkdtemp(prefix="csbp_convert_")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        created_pg = True
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1)
        created_mpu = True
    try:
        yield
    finally:
        if created_mpu:
            mpu.destroy_model_parallel()
        if created_pg:
            dist.destroy_process_group()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def save_gpt_model(model, shape: ModelShape, output: str, assets_from: Optional[str] = None) -> str:
    """Save `model` (any parallel layout: every rank calls this) as a release checkpoint."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank() if dist.is_initialized() else 0
    ckpt_dir = os.path.join(output, RELEASE)
    if rank == 0:
        if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
            raise FileExistsError(f"{ckpt_dir} exists and is not empty: choose a new --output")
        os.makedirs(ckpt_dir, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    state = {MODEL_KEY: model.sharded_state_dict(), "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}
    dist_checkpointing.save(state, ckpt_dir)
    if rank == 0:
        text = shape.to_json()
        for d in (output, ckpt_dir):
            with open(os.path.join(d, SHAPE_FILE), "w") as f:
                f.write(text)
        with open(os.path.join(output, TRACKER_FILE), "w") as f:
            f.write(RELEASE)
        if assets_from is not None:
            from megatron_csbp.conversion.hf_io import copy_assets

            copy_assets(assets_from, os.path.join(output, ASSETS_DIR))
    if dist.is_initialized():
        dist.barrier()
    return ckpt_dir


def load_gpt_model(load: Union[str, CheckpointModel], params_dtype: Optional[torch.dtype] = None,
                   block_diffusion: bool = True,
                   **config_overrides):
    """The checkpoint's model (converted or trainer-written, any layout) built under the current
    parallel state with its weights: `megatron_csbp.model.checkpoint.load_checkpoint_model`.
    Returns (model, shape)."""
    model, info = load_checkpoint_model(load, params_dtype, block_diffusion, **config_overrides)
    return model, info.shape
