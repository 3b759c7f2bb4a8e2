"""Training data in Megatron's formats, indexed by global sample index.

- `MockDataset`: deterministic synthetic sequences, a function of (seed, split, sample index) only
  (no rank, no layout), with learnable structure (noisy arithmetic progressions), so `--mock-data`
  loss curves go down and are identical under every layout.
- `build_gpt_datasets`: `--data-path` (blends: `W1 P1 W2 P2 ...`) and `--split` through Megatron's
  `BlendedMegatronDatasetBuilder` + `GPTDataset` (packing documents to `--seq-length`, EOD between
  documents as written by the preprocessing step). Samples have exactly `--seq-length` tokens
  (`add_extra_token_to_sequence=False`: the block-diffusion objectives predict positions in place;
  `--objective ar` shifts inside the objective). The loss mask is all ones.
- `SFTDataset` (see `megatron_csbp.data.sft`): conversations or prompt/response pairs with loss masks.

`microbatch_indices` gives the global sample indices of (iteration, micro-batch, DP rank): the same
arithmetic as Megatron-LM's `MegatronPretrainingSampler` (consumed samples, micro-batch x DP).
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron_csbp.objectives.base import sample_generator


class MegatronTokenizerAdapter:
    """The attributes Megatron's datasets use (`vocab_size`, `eod`, `pad`), plus text helpers."""

    def __init__(self, tokenizer=None, vocab_size: Optional[int] = None, eod: Optional[int] = None):
        self.tokenizer = tokenizer
        if tokenizer is not None:
            self.vocab_size = tokenizer.vocab_size
            self.eod = tokenizer.eod
            self.mask_token_id = tokenizer.mask_token_id
        else:  # NullTokenizer: ids only, the last id is EOD, the one before is the mask token
            self.vocab_size = vocab_size
            self.eod = vocab_size - 1 if eod is None else eod
            self.mask_token_id = vocab_size - 2
        self.pad = -1
        # Megatron's dataset cache keys hash this (its MegatronTokenizer has the same attribute).
        model = getattr(tokenizer, "model_path", None) or getattr(tokenizer, "path", None)
        self.unique_identifiers = {"class": "MegatronTokenizerAdapter", "model": str(model),
                                   "vocab_size": self.vocab_size, "eod": self.eod}

    def tokenize(self, text: str) -> List[int]:
        if self.tokenizer is None:
            return [int(t) for t in text.split()]
        return self.tokenizer.tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.detokenize(list(ids))


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str], vocab_size: Optional[int]):
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        from megatron_csbp.data.tokenizer import DEFAULT_MODEL, SentencePieceTokenizer

        path = tokenizer_model or DEFAULT_MODEL
        if not os.path.exists(path):
            raise ValueError(f"--tokenizer-model {path} does not exist")
        return MegatronTokenizerAdapter(SentencePieceTokenizer(path))
    if tokenizer_type == "NullTokenizer":
        if not vocab_size:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return MegatronTokenizerAdapter(None, vocab_size=vocab_size)
    raise ValueError(f"--tokenizer-type must be SentencePieceTokenizer or NullTokenizer, got {tokenizer_type!r}")


class MockDataset(torch.utils.data.Dataset):
    """Deterministic synthetic tokens from (seed, split, sample index).

    Each sample is a few runs of arithmetic progressions `a, a+s, a+2s, ...` modulo the usable
    vocabulary (ids below `num_ids`), with 5% random replacements: context makes the next tokens
    predictable, so the loss falls with training.
    """

    SPLIT_TAG = {"train": 0, "valid": 1, "test": 2}

    def __init__(self, seq_length: int, num_ids: int, seed: int, split: str = "train", size: int = 10 ** 9):
        if num_ids < 4:
            raise ValueError("--vocab-size too small for --mock-data")
        self.seq_length, self.num_ids, self.seed, self.size = seq_length, num_ids, seed, size
        self.tag = self.SPLIT_TAG[split]

    def __len__(self):
        return self.size

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        g = sample_generator(self.seed * 7919 + 104729 * (self.tag + 1), int(idx))
        L, V = self.seq_length, self.num_ids
        out = torch.empty(L, dtype=torch.long)
        pos = 0
        while pos < L:
            run = int(torch.randint(L // 4, L + 1, (1,), generator=g))
            start = int(torch.randint(0, V, (1,), generator=g))
            step = int(torch.randint(1, 5, (1,), generator=g))
            n = min(run, L - pos)
            out[pos:pos + n] = (start + step * torch.arange(n)) % V
            pos += n
        flip = torch.rand(L, generator=g) < 0.05
        out = torch.where(flip, torch.randint(0, V, (L,), generator=g), out)
        return {"tokens": out, "loss_mask": torch.ones(L, dtype=torch.float32)}


class _GPTSampleView(torch.utils.data.Dataset):
    """Megatron's GPT/Blended dataset sample -> {tokens, loss_mask of ones}."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, idx):
        sample = self.dataset[int(idx) % len(self.dataset)]
        tokens = sample["tokens"].long()
        return {"tokens": tokens, "loss_mask": torch.ones(tokens.shape[0], dtype=torch.float32)}


def parse_data_path(data_path: Sequence[str]):
    """Megatron's blend syntax: `PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...`; a clear error otherwise."""
    from megatron.core.datasets.utils import get_blend_from_list

    if len(data_path) > 1 and len(data_path) % 2 == 0:
        try:
            [float(w) for w in data_path[::2]]
        except ValueError:
            pass
        else:
            for prefix in data_path[1::2]:
                _check_prefix(prefix)
            return get_blend_from_list(list(data_path))
    for item in data_path:
        _check_prefix(item)
    return get_blend_from_list(list(data_path))


def _check_prefix(prefix: str) -> None:
    for ext in (".bin", ".idx"):
        if not os.path.exists(prefix + ext):
            raise ValueError(f"--data-path: {prefix}{ext} does not exist (expected a prefix written by "
                             "python -m megatron_csbp.data.preprocess)")


def build_gpt_datasets(data_path: Sequence[str], split: str, seq_length: int, seed: int, tokenizer,
                       num_samples: Sequence[int], cache_dir: Optional[str] = None):
    """(train, valid, test) through Megatron's BlendedMegatronDatasetBuilder and GPTDataset."""
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    blend = parse_data_path(data_path)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        add_extra_token_to_sequence=False,
        mid_level_dataset_surplus=0.005,
    )
    # Rank 0 builds the index caches first, then everybody reads them (Megatron-LM's pattern).
    rank = dist.get_rank() if dist.is_initialized() else 0

    def build():
        return BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True, config).build()

    if dist.is_initialized() and dist.get_world_size() > 1:
        if rank == 0:
            datasets = build()
        dist.barrier()
        if rank != 0:
            datasets = build()
    else:
        datasets = build()
    return [None if d is None else _GPTSampleView(d) for d in datasets]


def microbatch_indices(consumed_samples: int, micro: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> List[int]:
    """Global sample indices of one micro-batch: Megatron-LM's pretraining sampler arithmetic."""
    start = consumed_samples + micro * micro_batch_size * dp_size + dp_rank * micro_batch_size
    return list(range(start, start + micro_batch_size))


def collate(dataset, indices: Sequence[int], device=None) -> Dict[str, torch.Tensor]:
    samples = [dataset[i] for i in indices]
    batch = {
        "tokens": torch.stack([s["tokens"] for s in samples]),
        "loss_mask": torch.stack([s["loss_mask"] for s in samples]),
        "sample_index": torch.tensor(list(indices), dtype=torch.long),
    }
    if device is not None:
        batch = {k: v.to(device) for k, v in batch.items()}
    return batch


class _Indexed(torch.utils.data.Dataset):
    """`dataset[i]` together with its global index (what `collate` needs)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return i, self.dataset[i]


def _collate_indexed(items):
    batch = {"tokens": torch.stack([s["tokens"] for _, s in items]),
             "loss_mask": torch.stack([s["loss_mask"] for _, s in items]),
             "sample_index": torch.tensor([i for i, _ in items], dtype=torch.long)}
    return batch


class MicroBatchSampler(torch.utils.data.Sampler):
    """This rank's micro-batches (lists of global sample indices) of the global batches from sample
    `start` up to `end`, in training order (`microbatch_indices`: Megatron-LM's pretraining sampler)."""

    def __init__(self, start: int, end: int, num_microbatches: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int):
        self.start, self.end, self.num_microbatches = start, end, num_microbatches
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.global_batch = num_microbatches * micro_batch_size * dp_size

    def __len__(self):
        return max(0, (self.end - self.start) // self.global_batch) * self.num_microbatches

    def __iter__(self):
        for consumed in range(self.start, self.end - self.global_batch + 1, self.global_batch):
            for j in range(self.num_microbatches):
                yield microbatch_indices(consumed, j, self.micro_batch_size, self.dp_rank, self.dp_size)


def train_batches(dataset, sampler: MicroBatchSampler, num_workers: int):
    """Micro-batches in training order, read by `num_workers` DataLoader worker processes
    (Megatron-LM's --num-workers; 0: in this process). Memory: at most 2 x num_workers micro-batches
    prefetched (DataLoader's default prefetch factor)."""
    return iter(torch.utils.data.DataLoader(_Indexed(dataset), batch_sampler=sampler, num_workers=num_workers,
                                            collate_fn=_collate_indexed, persistent_workers=False))
