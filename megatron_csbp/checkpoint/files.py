"""What a Megatron checkpoint folder holds, whoever wrote it (the trainer, `convert hf-to-megatron`,
Megatron-LM): the one reader that `convert megatron-to-hf`, `convert score`, `convert flags`,
`generate` and the trainer share, and the refusals of a `--load` that cannot be read
(`CheckpointError`). `read_checkpoint_model(DIR).shape` is the shape file's `ModelShape`, or the
one the saved flags describe (`model.families.gpt.shape_of_flags`). The layout and refusals:
docs/training.md#checkpoints, docs/conversion.md.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from megatron_csbp.config.options import SHAPE_FLAGS
from megatron_csbp.model.families import SHAPE_FILE, ModelShape
from megatron_csbp.utils.cli import CliError

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
META_FILE = "bdlm_meta.json"
ASSETS_DIR = "hf_assets"
MODEL_KEY = "model"
#: a LoRA checkpoint's record (its LoRA config and base) in each iteration folder: lora/checkpoint.py
LORA_FILE = "megatron_csbp_lora.json"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def checkpoint_path(root: str, iteration) -> str:
    return os.path.join(root, RELEASE) if iteration == RELEASE else iteration_dir(root, iteration)


def read_tracker(root: str):
    """The tracker's iteration (int), `RELEASE` for a converted checkpoint, or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = Path(path).read_text().strip()
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
    meta_file = os.path.join(path, META_FILE)
    meta = json.loads(Path(meta_file).read_text()) if os.path.isfile(meta_file) else {}
    # The iteration folder's own shape file first: a root copy may belong to a newer save.
    for d in (path, load, os.path.dirname(os.path.abspath(path))):
        shape_file = os.path.join(d, SHAPE_FILE)
        if os.path.isfile(shape_file):
            return CheckpointModel(path, load, iteration, meta, ModelShape.from_json(Path(shape_file).read_text()))
    if not meta.get("model_args"):
        raise FileNotFoundError(
            f"--load {load}: {path} has neither {SHAPE_FILE} (written by `convert hf-to-megatron` and copied into "
            f"every checkpoint trained from it) nor {META_FILE} with model_args (written by megatron_csbp.train)")
    return CheckpointModel(path, load, iteration, meta)


class CheckpointError(CliError, ValueError):
    """A checkpoint that cannot be loaded or saved, with the flag or file that says why (a
    ValueError too: at parse time it is bad input, refused like any flag)."""


def saved_iterations(root: str) -> List[int]:
    """The complete `iter_N` folders under `root` (saves in progress excluded), ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("iter_") and n[5:].isdigit()
                  and os.path.isdir(os.path.join(root, n)))


def checkpoint_to_load(root: Optional[str], ckpt_step: Optional[int] = None):
    """What `--load root [--ckpt-step N]` loads: an iteration, `RELEASE`, or None (nothing saved
    there yet: a fresh run, as Megatron-LM starts when its --load holds no checkpoint). Refuses a
    `--ckpt-step` that was not saved and a tracker whose folder is gone, naming what is there."""
    if ckpt_step is not None and not root:
        raise CheckpointError(f"--ckpt-step {ckpt_step} needs --load DIR")
    if not root:
        return None
    step = ckpt_step if ckpt_step is not None else read_tracker(root)
    if step is not None and not os.path.isdir(checkpoint_path(root, step)):
        saved = saved_iterations(root)
        have = f"it holds iterations {', '.join(map(str, saved))}" if saved else "it holds no iter_N checkpoint"
        what = f"--ckpt-step {ckpt_step}" if ckpt_step is not None else f"{TRACKER} (iteration {step})"
        raise CheckpointError(f"{what}: --load {root} has no {os.path.basename(checkpoint_path(root, step))} ({have})")
    return step


def saved_model_args(root: str, step) -> Optional[Dict[str, Any]]:
    """The model flags the checkpoint was trained with (`bdlm_meta.json` "model_args"), or None
    (a converted release has none: its shape file is the reference)."""
    meta = None if step == RELEASE else _checkpoint_json(root, step, META_FILE)
    return None if meta is None else dict(meta.get("model_args") or {})


def _checkpoint_json(root: Optional[str], step, name: str) -> Optional[Dict[str, Any]]:
    """The JSON file `name` of checkpoint `step` of `root`, or None when it has none."""
    path = os.path.join(checkpoint_path(root, step), name) if root and step is not None else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"--load {root}: cannot read {path}: {exc}") from None


def lora_record(root: Optional[str], step) -> Optional[Dict[str, Any]]:
    """The `LORA_FILE` of checkpoint `step` of `root` ({"lora": LoRA config, "base": {"path",
    "iteration", "fingerprint"}}), or None: not a LoRA checkpoint."""
    return _checkpoint_json(root, step, LORA_FILE)


def model_source(load: Optional[str], load_step, pretrained: Optional[str]):
    """(flag, folder, iteration) of the checkpoint whose model a run builds: `--load`'s, or
    `--pretrained-checkpoint`'s when `--load` holds no checkpoint or a LoRA checkpoint (adapters only:
    the model is its base's, by default the one it records); None when neither holds one (a
    flag-built model from scratch)."""
    record = lora_record(load, load_step)
    if load_step is not None and record is None:
        return "--load", load, load_step
    if record is not None and not pretrained:
        pretrained = (record.get("base") or {}).get("path")  # None: trained on the --seed initialisation
        if pretrained and not os.path.isdir(pretrained):
            raise CheckpointError(f"--load {load} is a LoRA checkpoint whose base {pretrained} (recorded in its "
                                  f"{LORA_FILE}) is not here: give its base as --pretrained-checkpoint")
    if not pretrained:
        return None
    step = read_tracker(pretrained) if os.path.isdir(pretrained) else None
    if step is None or not os.path.isdir(checkpoint_path(pretrained, step)):
        raise CheckpointError(f"--pretrained-checkpoint {pretrained} holds no checkpoint (no {TRACKER} naming a "
                              "saved iteration): give a converted or trained checkpoint folder")
    if lora_record(pretrained, step) is not None:
        raise CheckpointError(f"--pretrained-checkpoint {pretrained} is a LoRA checkpoint (adapters only): give the "
                              f"base it was trained on ({LORA_FILE} names it), and the LoRA checkpoint as --load")
    return "--pretrained-checkpoint", pretrained, step


def check_model_flags(args, root: str, step, flag: str = "--load") -> None:
    """Refuse flags that build another model than the checkpoint's (its `bdlm_meta.json`), naming the
    first flag that differs, before megatron-core reads a tensor (its shape error names neither)."""
    saved = saved_model_args(root, step)
    if not saved:
        return
    where = f"{flag} {root}, {os.path.basename(checkpoint_path(root, step))}/bdlm_meta.json"
    for dest in SHAPE_FLAGS:
        given = getattr(args, dest, None)
        if saved.get(dest) is None or not hasattr(args, dest) or given == saved[dest]:
            continue
        if dest == "vocab_size" and args.tokenizer_type == saved.get("tokenizer_type") == "NullTokenizer":
            from megatron_csbp.data.megatron_data import null_tokenizer_rule, null_tokenizer_vocab_flag

            # (a checkpoint saved before the trainer took Megatron-LM's meaning counted the EOD in V)
            raise CheckpointError(
                f"--vocab-size {null_tokenizer_vocab_flag(given)} gives {given} token ids, the checkpoint's "
                f"NullTokenizer has {saved[dest]} ({where}; {null_tokenizer_rule()}): resume with --vocab-size "
                f"{null_tokenizer_vocab_flag(saved[dest])}")
        raise CheckpointError(f"--{dest.replace('_', '-')} {given} differs from the checkpoint's {saved[dest]} "
                              f"({where}): resume with the model flags it was trained with")
    mask, saved_mask = getattr(args, "mask_token_id", None), saved.get("mask_token_id")
    if (saved_mask is not None and mask != saved_mask and saved.get("objective") == getattr(args, "objective", None)
            and not getattr(args, "finetune", False)):
        # e.g. a NullTokenizer checkpoint from before the default mask id became the first padding id
        raise CheckpointError(f"--mask-token-id {mask} differs from the checkpoint's {saved_mask} ({where}): the model "
                              f"was trained to fill that id; resume with --mask-token-id {saved_mask}")


def verify_files(path: str) -> Optional[str]:
    """Why the torch_dist checkpoint folder `path` cannot be read (a missing or unreadable
    `.metadata`, a data file missing or shorter than `.metadata` says), or None when every file is
    whole. Reads only the metadata and the file sizes."""
    from torch.distributed.checkpoint import FileSystemReader

    meta_file = os.path.join(path, ".metadata")
    if not os.path.isfile(meta_file):
        return f"{meta_file} is missing (not a torch_dist checkpoint, or an interrupted copy)"
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # pickle, EOF, ...: the file is damaged
        return f"{meta_file} is corrupt or truncated ({type(exc).__name__}: {exc})"
    needed: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(needed.items()):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            return f"{f} is missing"
        have = os.path.getsize(f)
        if have < size:
            return f"{f} is truncated ({have} bytes; .metadata says at least {size})"
    return None


def checkpoint_shape(root: Optional[str], iteration=None):
    """The `ModelShape` of a converted model's checkpoint `--load root` would load (its
    `megatron_csbp_model.json`), or None (no checkpoint, or a flag-built one: the model is built
    from the flags). `read_checkpoint_model` reads it."""
    if not root or not os.path.isdir(root):
        return None
    if iteration is None and read_tracker(root) is None:
        # Nothing saved yet. A shape file alone in `root` still names the model to build (a recipe
        # validated against a released model's shape; a run that starts from that architecture).
        p = os.path.join(root, SHAPE_FILE)
        return ModelShape.from_json(Path(p).read_text()) if os.path.isfile(p) else None
    try:
        return read_checkpoint_model(root, iteration).file_shape
    except FileNotFoundError as exc:  # a tracker naming a missing or incomplete checkpoint
        raise ValueError(str(exc)) from None


def first_existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def unwritable(folder: str) -> Optional[str]:
    """Why no checkpoint can be written into `folder` (created if absent), or None: its nearest
    existing ancestor is a file, or a probe file cannot be created there (read-only file system,
    permissions). Writes and removes one empty file."""
    base = first_existing(folder)
    if not os.path.isdir(base):
        return f"{base} is a file, not a folder"
    try:
        tempfile.NamedTemporaryFile(dir=base, prefix=".megatron_csbp-probe-").close()  # created, then removed
    except OSError as exc:
        return f"cannot create a file in {base} ({os.strerror(exc.errno) if exc.errno else exc})"
    return None


def check_run_folders(args, load_step, start_iteration: int, load_claimed: bool = False) -> None:
    """At parse time, before anything is written: `--load` is a checkpoint folder, or holds none and
    starting from scratch is meant (it is the `--save` folder of a resumable job's first run, or
    --no-exit-on-missing-checkpoint); `--save` can be written and its tracker is not ahead of
    `start_iteration` (a save would move it back). `load_claimed`: the objective reads --load itself.
    docs/training.md#checkpoints."""
    load, save = args.load, args.save
    if load and load_step is None and not load_claimed:
        if os.path.isfile(load):
            raise CheckpointError(f"--load {load} is a file, not a checkpoint folder: give the folder that holds "
                                  f"{TRACKER} (--load {os.path.dirname(load) or '.'})")
        if os.path.isfile(os.path.join(load, "metadata.json")):
            parent, name = os.path.split(os.path.normpath(load))
            step = f" --ckpt-step {int(name[5:])}" if name.startswith("iter_") and name[5:].isdigit() else ""
            raise CheckpointError(f"--load {load} is one iteration's folder: give the checkpoint folder that holds it "
                                  f"(--load {parent or '.'}{step})")
        saved = saved_iterations(load)
        why = (f"it holds {', '.join(f'iter_{i:07d}' for i in saved[:3])} but no {TRACKER}" if saved else
               f"no {TRACKER}" + ("" if os.path.isdir(load) else "; the folder does not exist"))
        same = bool(save) and os.path.realpath(load) == os.path.realpath(save)
        fresh = (same and not saved) or not getattr(args, "exit_on_missing_checkpoint", True)
        if not fresh:  # (--load = --save, empty: a resumable job's first run)
            raise CheckpointError(f"--load {load} holds no checkpoint ({why}): check the path; to start from scratch "
                                  "on purpose drop --load, or pass --no-exit-on-missing-checkpoint")
    if save:
        why = unwritable(save)
        if why:
            raise CheckpointError(f"--save {save}: {why}")
        ahead = read_tracker(save) if os.path.isdir(save) else None
        if isinstance(ahead, int) and ahead > start_iteration and not getattr(args, "skip_train", False):
            raise CheckpointError(
                f"--save {save} holds checkpoints up to iteration {ahead} ({TRACKER}) and this run starts at iteration "
                f"{start_iteration}: its saves would move the tracker back; resume with --load {save}, or give "
                "another --save")
