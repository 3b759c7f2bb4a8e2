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


class FeatureSplit:
    """Sequences [first, first + count) of a `FeatureDataset`, as the trainer reads them: item i is
    sequence `first + i % count` (training wraps around its share) as [L] int64 tensors `tokens`,
    `loss_mask`, `document_ids`; `data_index(i)` is that sequence's index in the features (the
    DFlash model reads its rows of `features` there, and draws its anchors by it)."""

    def __init__(self, data: FeatureDataset, first: int, count: int):
        self.data, self.first, self.count = data, first, count

    def __len__(self) -> int:
        return self.count

    def data_index(self, i: int) -> int:
        if self.count <= 0:
            raise IndexError("no held-out captured sequences: give --eval-sequences N")
        return self.first + int(i) % self.count

    def __getitem__(self, i: int) -> Dict:
        import torch

        item = self.data[self.data_index(i)]
        return {"tokens": torch.from_numpy(item["tokens"].astype(np.int64)),
                "loss_mask": torch.from_numpy(item["loss_mask"].astype(np.int64)),
                "document_ids": torch.from_numpy(item["doc_ids"].astype(np.int64))}
