"""The DFlash drafter's checkpoints: a folder with `megatron_csbp_drafter.json` (its `DrafterShape`)
and either the trainer's torch_dist checkpoints (`python -m megatron_csbp.train --objective dflash
--save`) or `drafter.pt` (the `model.dflash.DFlashDrafter` state dict: `convert hf-to-megatron` of a
drafter, or an older `dflash train --save`; no optimizer state, one process). Every read of the
folder is here: the trainer's (`trainer_drafter`), export's (`read_drafter`), speculative decoding's
(`drafter_from_hf`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from megatron_csbp.checkpoint.files import checkpoint_path, read_tracker
from megatron_csbp.model.dflash import SHAPE_FILE, WEIGHTS_FILE, DrafterShape, load_drafter_state


def is_drafter_checkpoint(load: str) -> bool:
    return os.path.isfile(os.path.join(load, SHAPE_FILE))


def read_shape(load: str) -> Optional[DrafterShape]:
    """The `DrafterShape` of the folder `load`; None when it holds no drafter (a `drafter.pt`
    without its shape file is refused)."""
    if is_drafter_checkpoint(load):
        return DrafterShape.from_json(Path(load, SHAPE_FILE).read_text())
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
    Path(output, SHAPE_FILE).write_text(shape.to_json())
    os.replace(tmp, os.path.join(output, WEIGHTS_FILE))


def read_drafter(load: str):
    """The drafter of `load` on one process: its `drafter.pt` when it has one, else the newest torch_dist
    checkpoint `python -m megatron_csbp.train --objective dflash --save` wrote there (with its
    `megatron_csbp_drafter.json`)."""
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.utils import sharded_state_dict_default

    from megatron_csbp.checkpoint.integrity import check_checkpoint_files
    from megatron_csbp.model.dflash import DFlashDrafter

    shape, weights = read_shape(load), os.path.join(load, WEIGHTS_FILE)
    if shape is None:
        raise ValueError(f"--load {load}: no {SHAPE_FILE} (not a drafter checkpoint)")
    model = DFlashDrafter(shape)
    if os.path.isfile(weights):
        return load_drafter_state(model, torch.load(weights, map_location="cpu"), f"drafter checkpoint {load}")
    step = read_tracker(load)
    if step is None:
        raise ValueError(f"--load {load}: neither {WEIGHTS_FILE} nor a training checkpoint")
    wanted = sharded_state_dict_default(model, "")
    check_checkpoint_files(checkpoint_path(load, step))
    state = dist_checkpointing.load(wanted, checkpoint_path(load, step))  # (plus the checkpoint's common state)
    return load_drafter_state(model, {k: v for k, v in state.items() if k in wanted}, f"drafter checkpoint {load}")


def trainer_drafter(a, hidden_size: int):
    """(shape, weights) of the trainer's drafter (ModelArgs `a` of --objective dflash): the --load
    drafter's shape, else the flags' (`hidden_size`: the captured features'); weights: a callable
    giving the --load folder's `drafter.pt` state (an import or an older `dflash train --save`:
    weights only, iteration 0, fresh optimizer), else None (drawn from --seed). With --save, rank 0
    writes the shape and the verifier record there (what `--load` and the export read)."""
    from megatron_csbp.model.dflash import drafter_shape_from_args, drafter_state, record_verifier

    load, save = a.dflash_drafter_load, a.dflash_drafter_save
    shape = read_shape(load) if load else drafter_shape_from_args(a, hidden_size)
    if shape.hidden_size != hidden_size:
        raise ValueError(f"--load {load}: the drafter's hidden size {shape.hidden_size} differs from the features' "
                         f"{hidden_size}")
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    weights = None
    if load and os.path.isfile(os.path.join(load, WEIGHTS_FILE)):
        def weights():
            state = drafter_state(read_drafter(load))
            if rank0:
                print(f" loaded drafter weights {os.path.join(load, WEIGHTS_FILE)} (an import or an older dflash "
                      "train --save: weights only, iteration 0, fresh optimizer)", flush=True)
            return state
    if save and rank0:
        os.makedirs(save, exist_ok=True)
        Path(save, SHAPE_FILE).write_text(shape.to_json())
        record_verifier(save, a.verifier)  # its tokenizer goes with the export
    return shape, weights


def drafter_from_hf(hf_drafter):
    """(the Hugging Face drafter imported into the Megatron drafter, its DrafterShape)."""
    from megatron_csbp.model.dflash import DFlashDrafter, load_hf_drafter

    shape = DrafterShape.from_hf_config(hf_drafter.config.to_dict())
    drafter = DFlashDrafter(shape)
    load_hf_drafter(drafter, hf_drafter)
    return drafter, shape
