"""The DFlash drafter's checkpoints: a folder with `megatron_csbp_drafter.json` (its `DrafterShape`)
and either the trainer's torch_dist checkpoints (`python -m megatron_csbp.train --objective dflash
--save`) or `drafter.pt` (the `model.dflash.DFlashDrafter` state dict: `convert hf-to-megatron` of a
drafter, or an older `dflash train --save`; no optimizer state, one process)."""
from __future__ import annotations

import os

import torch

from megatron_csbp.checkpoint.files import checkpoint_path, read_tracker
from megatron_csbp.model.dflash import SHAPE_FILE, WEIGHTS_FILE, DrafterShape


def is_drafter_checkpoint(load: str) -> bool:
    return os.path.isfile(os.path.join(load, SHAPE_FILE))


def drafter_shape(load: str):
    """The `DrafterShape` of the drafter folder `load` (None: no drafter there); a `drafter.pt`
    without its shape file is refused."""
    if is_drafter_checkpoint(load):
        return DrafterShape.from_json(open(os.path.join(load, SHAPE_FILE)).read())
    if os.path.isfile(os.path.join(load, WEIGHTS_FILE)):
        raise ValueError(f"--load {load}: {WEIGHTS_FILE} without {SHAPE_FILE}: not a drafter this project wrote")
    return None


def save_drafter(state, shape: DrafterShape, output: str) -> None:
    """Write a drafter checkpoint (atomically: a temporary file renamed)."""
    os.makedirs(output, exist_ok=True)
    if os.path.exists(os.path.join(output, WEIGHTS_FILE)):
        raise FileExistsError(f"{output} already holds a drafter: choose a new --output")
    tmp = os.path.join(output, WEIGHTS_FILE + ".tmp")
    torch.save({k: v.contiguous().clone() for k, v in state.items()}, tmp)
    with open(os.path.join(output, SHAPE_FILE), "w") as f:
        f.write(shape.to_json())
    os.replace(tmp, os.path.join(output, WEIGHTS_FILE))


def load_drafter(path: str):
    """The `DFlashDrafter` of the checkpoint folder `path`, its weights loaded."""
    from megatron_csbp.model.dflash import DFlashDrafter

    model = DFlashDrafter(DrafterShape.from_json(open(os.path.join(path, SHAPE_FILE)).read()))
    return _loaded(model, torch.load(os.path.join(path, WEIGHTS_FILE), map_location="cpu"), path)


def _loaded(model, state, path: str):
    """`model` with `state` loaded (its `_extra_state` entries may be missing, nothing else)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"drafter checkpoint {path}: missing {missing}, unexpected {unexpected}")
    return model


def load_trained_drafter(load: str):
    """The drafter of the newest torch_dist checkpoint `python -m megatron_csbp.train --objective
    dflash --save` wrote in `load` (with its `megatron_csbp_drafter.json`), on one process."""
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.utils import sharded_state_dict_default

    from megatron_csbp.model.dflash import DFlashDrafter

    if not os.path.isfile(os.path.join(load, SHAPE_FILE)):
        raise ValueError(f"--load {load}: no {SHAPE_FILE} (not a drafter checkpoint)")
    step = read_tracker(load)
    if step is None:
        raise ValueError(f"--load {load}: neither {WEIGHTS_FILE} nor a training checkpoint")
    model = DFlashDrafter(DrafterShape.from_json(open(os.path.join(load, SHAPE_FILE)).read()))
    wanted = sharded_state_dict_default(model, "")
    from megatron_csbp.checkpoint.integrity import check_checkpoint_files

    check_checkpoint_files(checkpoint_path(load, step))
    state = dist_checkpointing.load(wanted, checkpoint_path(load, step))  # (plus the checkpoint's common state)
    return _loaded(model, {k: v for k, v in state.items() if k in wanted}, load)


def read_drafter(load: str):
    """The drafter of `load` on one process: its `drafter.pt` when it has one, else its newest
    torch_dist checkpoint."""
    return load_drafter(load) if os.path.isfile(os.path.join(load, WEIGHTS_FILE)) else load_trained_drafter(load)
