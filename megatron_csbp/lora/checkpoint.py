"""LoRA checkpoints: a training checkpoint folder (tracker, `iter_N/`, torch_dist) whose model state
is the adapters alone, beside `files.LORA_FILE` (the LoRA config and the base: its
--pretrained-checkpoint path, iteration and `integrity.fingerprint`). The trainer's load and save
use `base_record`, `check_resume` and `record_json`; the PEFT export/import and generation use
`read_lora_checkpoint` / `write_lora_checkpoint`. Rules and format: docs/lora.md#checkpoints."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint import FileSystemReader

from megatron_csbp.checkpoint.files import (
    LORA_FILE, RELEASE, TRACKER, CheckpointError, checkpoint_path, checkpoint_to_load, lora_record,
)
from megatron_csbp.checkpoint.integrity import check_checkpoint_files, fingerprint, write_checksums
from megatron_csbp.checkpoint.model import single_process_megatron
from megatron_csbp.lora import LoRAConfig, is_adapter

#: the LoRA flags a resume must repeat (they shape the adapters or their scale), by LoRAConfig field
RESUMED = {"rank": "--lora-rank", "alpha": "--lora-alpha", "target_modules": "--lora-target-modules"}


def base_record(pretrained: str) -> Dict[str, Any]:
    """Collective: {"path", "iteration", "fingerprint"} of the base `--pretrained-checkpoint` loads
    (its tracker's checkpoint)."""
    step = checkpoint_to_load(pretrained)
    if step is None:
        raise CheckpointError(f"--pretrained-checkpoint {pretrained} holds no checkpoint (no {TRACKER})")
    return {"path": os.path.abspath(pretrained), "iteration": step,
            "fingerprint": fingerprint(checkpoint_path(pretrained, step))}


def record_json(config: LoRAConfig, base: Dict[str, Any]) -> str:
    return json.dumps({"lora": dataclasses.asdict(config), "base": base}, indent=1, sort_keys=True)


def check_resume(load: str, step, config: Optional[LoRAConfig], base: Optional[Dict[str, Any]]) -> None:
    """Before `--load load` (checkpoint `step`) is read: a LoRA run (`config`) loads LoRA checkpoints
    of its LoRA flags trained on its base (`base`: `base_record` of --pretrained-checkpoint), a full
    run full checkpoints; otherwise one line naming the flags."""
    record = lora_record(load, step)
    if record is None:
        if config is not None:
            raise CheckpointError(
                f"--load {load} holds a full (non-LoRA) checkpoint, and --lora-rank {config.rank} resumes LoRA "
                f"checkpoints only (no {LORA_FILE}): to train adapters on it, give it as --pretrained-checkpoint")
        return
    saved = LoRAConfig(**record["lora"])
    if config is None:
        raise CheckpointError(
            f"--load {load} holds a LoRA checkpoint (rank {saved.rank} adapters, {LORA_FILE}): resume it with "
            f"--lora-rank {saved.rank} and its other --lora-* flags, or merge it into its base (convert "
            "megatron-to-hf --merge-lora)")
    for name, flag in RESUMED.items():
        given, had = getattr(config, name), getattr(saved, name)
        if given != had:
            raise CheckpointError(f"{flag} {_flag_text(given)} differs from the --load {load} LoRA checkpoint's "
                                  f"{_flag_text(had)} ({LORA_FILE}): resume with the LoRA flags it was trained with")
    old = record.get("base")
    if (old or {}).get("fingerprint") != (base or {}).get("fingerprint"):
        raise CheckpointError(
            f"--load {load} holds adapters trained on {_base_text(old)} but --pretrained-checkpoint is "
            f"{_base_text(base)}: give the same base as --pretrained-checkpoint")


def _base_text(base: Optional[Dict[str, Any]]) -> str:
    if base is None:
        return "no base (no --pretrained-checkpoint: the --seed initialisation)"
    return f"the base {base['path']} (iteration {base['iteration']}, {base['fingerprint'][:19]}...)"


def _flag_text(value) -> str:
    return ",".join(value) if isinstance(value, (tuple, list)) else str(value)


# ---- one process: the adapters as full tensors by their one-process names ---------------------
#
# megatron-core stores the layers of a block as one tensor per module with the global layer index as
# a first axis (key "decoder.layers.self_attention.linear_qkv.lora_A", [layers, r, in]; by layer number,
# "decoder.layers.3.", when the layers differ), and a sequential MLP's experts with the global expert
# index as the next axis ("decoder.layers.mlp.experts.experts.linear_fc1.lora_A": SequentialMLP's
# sharded_state_dict). An adapter is a matrix, so its key has ndim - 2 such axes; each (layer,
# expert) fragment is one tensor of a one-process model, named like the base weights
# ("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.lora_A").

#: per stacked axis (layer, expert): the torch_dist key's part, and the one-process name's
_AXES = (("decoder.layers.", "decoder.layers.{}."), (".experts.experts.", ".experts.local_experts.{}."))
#: (the one-process name's part, its index captured; the torch_dist key's part) per axis
_INDEX = [(re.compile(re.escape(named).replace(r"\{\}", r"(\d+)")), stacked) for stacked, named in _AXES]


def _stacked_axes(key: str):
    """The stacked axes (layer, then expert) of the torch_dist key `key`, in order."""
    return [(stacked, named) for stacked, named in _AXES if re.search(re.escape(stacked) + r"(?!\d)", key)]


def _name(key: str, index) -> str:
    for (stacked, named), i in zip(_stacked_axes(key), index):
        key = key.replace(stacked, named.format(i), 1)
    return key


def _key(name: str, shapes: Dict[str, Tuple[int, ...]]):
    """(torch_dist key, stacked indices, stacked sizes) of a one-process adapter name, as its base
    weight is stored (`shapes`: the base checkpoint's keys and global shapes): its layer and expert
    indices stacked, or left in the key (megatron-core's non-homogeneous layers, e.g. MoE every
    other layer)."""
    found = [(rx, repl) for rx, repl in _INDEX if rx.search(name)]
    for stack in itertools.product((True, False), repeat=len(found)):
        key, index = name, []
        for (rx, repl), stacked in zip(found, stack):
            if stacked:
                index.append(int(rx.search(key).group(1)))
                key = rx.sub(repl, key, count=1)
        base = shapes.get(key.rsplit(".", 1)[0] + ".weight")
        if base is not None and len(base) == 2 + len(index):
            return key, tuple(index), base[:len(index)]
    raise ValueError(f"write_lora_checkpoint: {name}: the base has no weight for this adapter")


def _fragment(key: str, data: torch.Tensor, index, stacked) -> "ShardedTensor":
    from megatron.core.dist_checkpointing import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, data, *[(a, i, n) for a, (i, n) in enumerate(zip(index, stacked))],
                                           replica_id=0, prepend_axis_num=len(index))


def read_lora_checkpoint(load: str, step=None) -> Tuple[LoRAConfig, Dict[str, torch.Tensor], str]:
    """(LoRA config, {one-process name: full unsharded adapter tensor}, base path) of the LoRA
    checkpoint `load` (the tracker's, or iteration `step`), on one process, whatever layout saved it
    (layers and experts by their global index, as the base's weights are named)."""
    step = checkpoint_to_load(load, step)
    record = lora_record(load, step)
    if record is None:
        raise CheckpointError(f"--load {load}: not a LoRA checkpoint (no {LORA_FILE}"
                              f"{'' if step is not None else f', no {TRACKER}'})")
    path = checkpoint_path(load, step)
    wanted = {}
    for key, meta in FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if not is_adapter(key) or "optimizer." in key or not hasattr(meta, "chunks"):
            continue
        k = len(meta.size) - 2  # the stacked axes
        if k != len(_stacked_axes(key)):
            raise CheckpointError(f"--load {load}: {key} of shape {tuple(meta.size)} is not a stacked adapter matrix")
        for index in sorted({tuple(c.offsets[:k]) for c in meta.chunks}):
            data = torch.empty(tuple(meta.size[k:]), dtype=meta.properties.dtype)
            wanted[_name(key, index)] = _fragment(key, data, index, tuple(meta.size[:k]))
    with single_process_megatron():
        check_checkpoint_files(path)
        loaded = dist_checkpointing.load(wanted, path)
    adapters = {name: loaded[name] for name in wanted}  # (load also returns the checkpoint's common state)
    return LoRAConfig(**record["lora"]), adapters, (record.get("base") or {}).get("path")


def write_lora_checkpoint(out: str, config: LoRAConfig, adapters: Dict[str, torch.Tensor], base_path: str) -> str:
    """Write `adapters` ({one-process name: full tensor}, e.g. an imported PEFT adapter) as a LoRA
    checkpoint `out/release/` over the base `base_path` (its fingerprint recorded; the counts of
    layers and experts read from its metadata): a `--load` of a LoRA run starts from these adapters at
    iteration 0 with a fresh optimizer. One process."""
    bad = [n for n in adapters if not is_adapter(n)]
    if bad:
        raise ValueError(f"write_lora_checkpoint: {bad[:3]} are not adapter tensors (.lora_A / .lora_B)")
    folder = checkpoint_path(out, RELEASE)
    if os.path.isdir(folder) and os.listdir(folder):
        raise FileExistsError(f"{folder} exists and is not empty: choose a new --output")
    with single_process_megatron():
        base = base_record(base_path)
        metadata = FileSystemReader(checkpoint_path(base_path, base["iteration"])).read_metadata()
        shapes = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
        state = {}
        for name, t in adapters.items():
            key, index, stacked = _key(name, shapes)
            state[name] = _fragment(key, t.detach().contiguous().clone(), index, stacked)
        os.makedirs(folder, exist_ok=True)
        dist_checkpointing.save({"model": state, "iteration": 0}, folder)
        Path(folder, LORA_FILE).write_text(record_json(config, base))
        write_checksums(folder)
    Path(out, TRACKER).write_text(RELEASE)
    return folder
