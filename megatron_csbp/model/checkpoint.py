"""Which model a Megatron checkpoint holds, whoever wrote it: the one reader that `convert
megatron-to-hf`, `convert score`, `convert flags`, `generate` and the trainer share.

A checkpoint folder (`--load DIR`) is Megatron-LM's layout:

    DIR/latest_checkpointed_iteration.txt   an iteration number, or "release" (a converted model)
    DIR/iter_0000100/ or DIR/release/       the dist_checkpointing (torch_dist) files
        megatron_csbp_model.json            the ModelShape (converted models, and every checkpoint
                                            the trainer saves from one)
        bdlm_meta.json                      the trainer's model flags ("model_args"), iteration, ...
    DIR/megatron_csbp_model.json, DIR/hf_assets/   (copies of the shape file, Hugging Face assets)

`read_checkpoint_model` resolves the folder once; its `.shape` is the model's `ModelShape`: the
shape file's when there is one, else (a flag-built model the trainer wrote) the shape its saved
flags describe (`model.families.gpt.shape_of_flags`: `LlamaForCausalLM` / `Qwen3ForCausalLM` ...).
`load_checkpoint_model` builds that shape under the current parallel state and loads the weights
(dist_checkpointing reshards any TP / CP / BP / EP layout). DIR may also be the iteration folder
itself.

Size: a few hundred bytes of JSON per checkpoint; nothing here depends on tokens or ranks.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

from megatron_csbp.model.families import SHAPE_FILE, ModelShape

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
META_FILE = "bdlm_meta.json"
ASSETS_DIR = "hf_assets"
MODEL_KEY = "model"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def checkpoint_path(root: str, iteration) -> str:
    return os.path.join(root, RELEASE) if iteration == RELEASE else iteration_dir(root, iteration)


def read_tracker(root: str):
    """The tracker's iteration (int), `RELEASE` for a converted checkpoint, or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise ValueError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number or 'release'")
    return int(text)


@dataclass
class CheckpointModel:
    """What `--load` holds: the model and where its files are."""

    #: the folder with the dist_checkpointing files
    path: str
    #: the `--load` folder as given
    root: str
    #: iteration number, `RELEASE`, or None (`root` is an iteration folder itself)
    iteration: Any
    #: `bdlm_meta.json` (the trainer's checkpoints; {} for a converted release)
    meta: Dict[str, Any] = field(default_factory=dict)
    #: the shape file's model (a converted model and the checkpoints trained from it); None for a
    #: flag-built model the trainer wrote
    file_shape: Optional[ModelShape] = None

    @property
    def from_shape_file(self) -> bool:
        return self.file_shape is not None

    @property
    def model_args(self) -> Dict[str, Any]:
        """The trainer's saved model flags by dest name ({} when the trainer did not write it)."""
        return dict(self.meta.get("model_args") or {})

    @property
    def shape(self) -> ModelShape:
        """The model's shape: the shape file's, else the one the saved flags describe (raises
        UnsupportedModelError naming the flag when they describe a model no family holds)."""
        if self.file_shape is not None:
            return self.file_shape
        from megatron_csbp.model.families.gpt import shape_of_flags

        return shape_of_flags(self.model_args)

    @property
    def assets_dir(self) -> str:
        return os.path.join(self.root, ASSETS_DIR)


def _locate(load: str, step=None):
    """(folder with the torch_dist files, iteration) of `--load load` (at `step` if given)."""
    if not os.path.isdir(load):
        raise FileNotFoundError(f"--load {load}: no such folder")
    iteration = step if step is not None else read_tracker(load)
    if iteration is None:
        if os.path.isfile(os.path.join(load, "metadata.json")):
            return load, None  # an iteration folder itself
        raise FileNotFoundError(f"--load {load}: no {TRACKER} (and not a dist_checkpointing folder with "
                                "metadata.json): not a Megatron checkpoint")
    path = checkpoint_path(load, iteration)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"--load {load}: {path} is not a dist_checkpointing checkpoint (no metadata.json)")
    return path, iteration


def read_checkpoint_model(load: str, step=None) -> CheckpointModel:
    """The checkpoint of `--load load` (the tracker's, or iteration `step`). Raises
    FileNotFoundError when there is none; its `.shape` raises UnsupportedModelError when a
    flag-built model has no model shape (e.g. --normalization LayerNorm), naming the flag."""
    path, iteration = _locate(load, step)
    meta: Dict[str, Any] = {}
    meta_file = os.path.join(path, META_FILE)
    if os.path.isfile(meta_file):
        with open(meta_file) as f:
            meta = json.load(f)
    # The iteration folder's own shape file first: a root copy may belong to a newer save.
    for d in (path, load, os.path.dirname(os.path.abspath(path))):
        shape_file = os.path.join(d, SHAPE_FILE)
        if os.path.isfile(shape_file):
            with open(shape_file) as f:
                return CheckpointModel(path, load, iteration, meta, ModelShape.from_json(f.read()))
    if not meta.get("model_args"):
        raise FileNotFoundError(
            f"--load {load}: {path} has neither {SHAPE_FILE} (written by `convert hf-to-megatron` and copied into "
            f"every checkpoint trained from it) nor {META_FILE} with model_args (written by megatron_csbp.train)")
    return CheckpointModel(path, load, iteration, meta)


def load_checkpoint_model(checkpoint: Union[str, CheckpointModel], params_dtype=None, block_diffusion: bool = True,
                          step=None, **config_overrides):
    """Build the checkpoint's model under the current parallel state and load its weights
    (dist_checkpointing reshards from the layout it was saved under). `config_overrides` set
    parallelism and training options of the TransformerConfig. Returns (model, CheckpointModel)."""
    from megatron.core import dist_checkpointing

    from megatron_csbp.model.builder import build_gpt_model

    info = checkpoint if isinstance(checkpoint, CheckpointModel) else read_checkpoint_model(checkpoint, step)
    shape = info.shape
    model = build_gpt_model(shape, block_diffusion=block_diffusion,
                            **dict(dict(params_dtype=params_dtype or shape.torch_dtype), **config_overrides))
    state = dist_checkpointing.load({MODEL_KEY: model.sharded_state_dict()}, info.path)
    try:
        load_model_weights(model, state[MODEL_KEY])
    except ValueError as exc:
        raise ValueError(f"--load {info.root}: the {shape.family} model of {info.path}: {exc}") from None
    return model, info


def load_model_weights(model, state: dict) -> None:
    """`load_state_dict` that ignores Megatron's (None) `_extra_state` entries but nothing else."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
