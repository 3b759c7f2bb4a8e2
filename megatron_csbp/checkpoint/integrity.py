"""Whether a checkpoint's files are the ones its save wrote: sizes against torch_dist's `.metadata`
(`files.verify_files`) and a SHA-256 of every file, written by every save (the trainer's and
`convert`'s, `CHECKSUM_FILE` in the iteration folder) and checked before every load. Each rank
hashes its share of the files; the verdict is agreed. Cost and refusals: docs/training.md#checkpoints.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Dict, List, Optional

import torch.distributed as dist

from megatron_csbp.checkpoint.files import CheckpointError, verify_files

CHECKSUM_FILE = "megatron_csbp_checksums.json"
ALGORITHM = "sha256"


def _world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all(value) -> List:
    """Every rank's `value` (collective when a process group is up)."""
    _, world = _world()
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def digest(path: str) -> str:
    h = hashlib.new(ALGORITHM)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 23), b""):
            h.update(chunk)
    return h.hexdigest()


def _digests(folder: str, names: List[str]) -> Dict[str, str]:
    """Collective: {name: digest} of the files `names` of `folder`, each rank hashing every world-th."""
    rank, world = _world()
    mine = {n: digest(os.path.join(folder, n)) for n in names[rank::world]}
    return {name: sha for part in _all(mine) for name, sha in part.items()}


def write_checksums(folder: str) -> None:
    """Collective: the digest of every file in `folder` (each rank hashes every world-th file)
    into `folder/CHECKSUM_FILE`, written by rank 0."""
    names = sorted(n for n in os.listdir(folder) if n != CHECKSUM_FILE and os.path.isfile(os.path.join(folder, n)))
    files = _digests(folder, names)
    if _world()[0] == 0:
        with open(os.path.join(folder, CHECKSUM_FILE), "w") as f:
            json.dump({"algorithm": ALGORITHM, "files": files}, f, indent=0, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())


def verify_checksums(folder: str) -> Optional[str]:
    """Collective: the first file of `folder` whose digest differs from `CHECKSUM_FILE`'s (or is
    missing), or None (also for a checkpoint saved without checksums: older, or Megatron-LM's)."""
    rank, world = _world()
    path = os.path.join(folder, CHECKSUM_FILE)
    if not os.path.isfile(path):
        return None
    try:
        expected = json.loads(Path(path).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path} is corrupt ({type(exc).__name__})"
    bad = []
    for name in sorted(expected)[rank::world]:
        f = os.path.join(folder, name)
        if not os.path.isfile(f):
            bad.append(f"{f} is missing")
        elif digest(f) != expected[name]:
            bad.append(f"{f} is corrupt: its {ALGORITHM} differs from the one its save wrote ({CHECKSUM_FILE})")
    found = sorted(b for part in _all(bad) for b in part)
    return found[0] if found else None


def check_checkpoint_files(path: str) -> None:
    """Collective, before a checkpoint is read: `verify_files` on rank 0 (its verdict broadcast),
    then every file's checksum; all ranks refuse together, naming the file."""
    rank, world = _world()
    verdict = [verify_files(path) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(verdict, src=0)
    why = verdict[0] or verify_checksums(path)
    if why is not None:
        raise CheckpointError(f"cannot load checkpoint {path}: {why}")


def fingerprint(folder: str) -> str:
    """Collective: what identifies the weights of the torch_dist checkpoint `folder` (a LoRA
    checkpoint records its base's): the sha256 of the (file, sha256) list of its tensor files, read
    from `CHECKSUM_FILE` when the save wrote one (a JSON read, whatever the checkpoint's size), else
    hashed here, each rank every world-th file (Megatron-LM's checkpoints)."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".distcp") or n == ".metadata")  # shards, index
    known: Dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        known = json.loads(Path(folder, CHECKSUM_FILE).read_text())["files"]
    todo = [n for n in names if n not in known]
    if todo:
        known.update(_digests(folder, todo))
    listing = json.dumps({n: known[n] for n in names}, sort_keys=True)
    return f"{ALGORITHM}:{hashlib.new(ALGORITHM, listing.encode()).hexdigest()}"
