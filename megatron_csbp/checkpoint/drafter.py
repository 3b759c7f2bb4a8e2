"""The DFlash drafter's checkpoint (`python -m megatron_csbp.dflash train --save`, `convert
hf-to-megatron` of a drafter): a folder with `drafter.pt` (the `model.dflash.DFlashDrafter` state
dict) and `megatron_csbp_drafter.json` (its `DrafterShape`); no optimizer state, one process."""
from __future__ import annotations

import os

import torch

from megatron_csbp.model.dflash import SHAPE_FILE, DrafterShape

WEIGHTS_FILE = "drafter.pt"


def is_drafter_checkpoint(load: str) -> bool:
    return os.path.isfile(os.path.join(load, SHAPE_FILE))


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

    shape = DrafterShape.from_json(open(os.path.join(path, SHAPE_FILE)).read())
    model = DFlashDrafter(shape)
    state = torch.load(os.path.join(path, WEIGHTS_FILE), map_location="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"drafter checkpoint {path}: missing {missing}, unexpected {unexpected}")
    return model
