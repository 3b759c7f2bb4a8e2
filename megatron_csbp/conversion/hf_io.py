"""Reading and writing Hugging Face checkpoint folders with the `safetensors` library only.

A folder holds `config.json`, either `model.safetensors` or shards listed in
`model.safetensors.index.json`, and tokenizer / generation files, which the converter carries
through unchanged. PyTorch `.bin` checkpoints are refused (convert them to safetensors first).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Small files that travel with the weights (tokenizer, generation defaults, chat template ...).
ASSET_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py", ".md")
WEIGHT_FILES = (INDEX_FILE, "config.json", "pytorch_model.bin.index.json")
MAX_ASSET_BYTES = 64 << 20


def read_config(path: str) -> Dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder: no config.json")
    return json.loads(Path(cfg_path).read_text())


def weight_files(path: str) -> List[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        files = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    if any(n.endswith(".bin") for n in os.listdir(path)):
        raise ValueError(f"{path} holds PyTorch .bin weights; only safetensors checkpoints are read "
                         "(re-save with save_pretrained(..., safe_serialization=True))")
    raise FileNotFoundError(f"{path} has no {SINGLE_FILE} or {INDEX_FILE}")


def read_tensors(path: str) -> Dict[str, torch.Tensor]:
    tensors: Dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name} appears in two shards of {path}")
                tensors[name] = f.get_tensor(name)
    return tensors


def write_tensors(path: str, tensors: Dict[str, torch.Tensor], max_shard_bytes: int = 5 << 30) -> List[str]:
    """Write `tensors` as one file or as shards plus an index (Hugging Face's layout)."""
    os.makedirs(path, exist_ok=True)
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return [SINGLE_FILE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(files, shards):
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
    weight_map = {k: name for name, shard in zip(files, shards) for k in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    Path(path, INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return files


def copy_assets(src: str, dst: str, exclude: Tuple[str, ...] = ()) -> List[str]:
    """Copy the tokenizer / generation / template files of the model folder `src` (everything small but
    weights; not `exclude`) into `dst`."""
    os.makedirs(dst, exist_ok=True)
    copied = [name for name in sorted(os.listdir(src)) if name.endswith(ASSET_SUFFIXES) and name not in WEIGHT_FILES
              and name not in exclude and os.path.isfile(os.path.join(src, name))
              and os.path.getsize(os.path.join(src, name)) <= MAX_ASSET_BYTES]
    for name in copied:
        shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    return copied
