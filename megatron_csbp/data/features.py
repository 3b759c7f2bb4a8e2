"""Captured DFlash verifier features on disk (`python -m megatron_csbp.dflash prepare-features`
writes them; the drafter trainer and `--objective dflash` read them).

A features folder holds `meta.json` and shards `shard_00000/` ... of `features.npy` [n, L, width],
`tokens.npy`, `loss_mask.npy`, `doc_ids.npy`, memory-mapped when read.
"""
from __future__ import annotations

import json
import os
from typing import Dict

import numpy as np

META = "meta.json"
FEATURE_FORMAT = 1


class FeatureDataset:
    """Captured features, memory-mapped: item i -> dict of [L] / [L, width] arrays (read lazily)."""

    def __init__(self, path: str):
        meta_path = os.path.join(path, META)
        if not os.path.exists(meta_path):
            raise FileNotFoundError(f"--features-path {path} has no {META}: run prepare-features first")
        self.meta = json.load(open(meta_path))
        self.path = path
        n, size = self.meta["num_sequences"], self.meta["shard_size"]
        self.shards = []
        for s in range((n + size - 1) // size):
            d = os.path.join(path, f"shard_{s:05d}")
            if not os.path.isdir(d):
                raise FileNotFoundError(f"--features-path {path}: shard {d} is missing (capture incomplete: rerun "
                                        "prepare-features with the same flags to resume)")
            self.shards.append({k: np.load(os.path.join(d, f"{k}.npy"), mmap_mode="r")
                                for k in ("features", "tokens", "loss_mask", "doc_ids")})

    def __len__(self) -> int:
        return self.meta["num_sequences"]

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        s, j = divmod(i, self.meta["shard_size"])
        return {k: v[j] for k, v in self.shards[s].items()}
