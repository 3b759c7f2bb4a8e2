"""Training data in Megatron's formats, indexed by global sample index: `MockDataset` (a function of
(seed, split, sample index) only), `build_gpt_datasets` (`--data-path` / `--split` through
Megatron's `GPTDataset`, configured as Megatron-LM's `pretrain_gpt.py` does, so the trainer and
`pretrain()` read the same tokens), `SFTDataset`, and `microbatch_indices` (Megatron-LM's sampler
arithmetic). docs/training.md#data.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch


def sample_generator(seed: int, sample_index: int) -> torch.Generator:
    """A CPU generator keyed by (seed, global sample index), independent of rank and layout (the
    objectives' noise and `MockDataset`'s draws)."""
    state = np.random.SeedSequence([int(seed), int(sample_index)]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


class MegatronTokenizerAdapter:
    """The attributes Megatron's datasets use (`vocab_size`, `eod`, `pad`), plus text helpers and
    the tokenizer's own mask token (`mask_token_id`, None when it has none)."""

    def __init__(self, tokenizer, null: bool = False):
        self.tokenizer, self.null = tokenizer, null  # null: megatron-core's NullTokenizer (ids as text)
        self.vocab_size, self.eod, self.pad = int(tokenizer.vocab_size), int(tokenizer.eod), -1
        self.mask_token_id = None if self.null else tokenizer.mask_token_id  # Megatron's NullTokenizer: mask -1
        # Megatron's dataset cache keys hash this (its MegatronTokenizer has the same attribute).
        model = getattr(tokenizer, "model_path", None) or getattr(tokenizer, "path", None)
        self.unique_identifiers = {"class": "MegatronTokenizerAdapter", "model": str(model),
                                   "vocab_size": self.vocab_size, "eod": self.eod}

    def tokenize(self, text: str) -> List[int]:
        if self.null:
            ids = [int(t) for t in text.split()]
            bad = [i for i in ids if not 0 <= i < self.eod]
            if bad:  # the EOD (and the mask id, a padding id above it) must never stand for data
                raise ValueError(f"NullTokenizer text holds the ids 0..{self.eod - 1} (EOD {self.eod}; "
                                 f"{null_tokenizer_rule()}), got {bad[0]}")
            return ids
        return self.tokenizer.tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        if self.null:
            return self.tokenizer.ids_to_text([int(i) for i in ids])
        return self.tokenizer.detokenize(list(ids))


#: Megatron-LM's `--tokenizer-type` names this project reads (the trainer, data.preprocess, generate).
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")

def null_tokenizer_counts_eod() -> bool:
    """Whether megatron-core's NullTokenizer(V), the class Megatron-LM's `--tokenizer-type
    NullTokenizer --vocab-size V` builds, counts the EOD among its V ids: megatron-core 0.19's holds
    ids 0..V-1 with EOD V-1 (data ids 0..V-2); 0.16.1's holds ids 0..V with EOD V (data ids 0..V-1).
    The one place the trainer, `data.preprocess`, `generate` and the checkpoint checks learn which
    (asked of the class, not of a version number)."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return int(NullTokenizer(2).vocab_size) == 2


def null_tokenizer_rule() -> str:
    """`--vocab-size V` with NullTokenizer in words, the installed megatron-core's (Megatron-LM's) meaning.
    Every NullTokenizer's EOD is its last id; the model pads its vocabulary to
    `--make-vocab-size-divisible-by` and the default mask id is the first padding id
    (`objectives.flags.default_mask_token_id`), so neither is ever a data id."""
    if null_tokenizer_counts_eod():
        return ("--tokenizer-type NullTokenizer --vocab-size V is Megatron-LM's (megatron-core >= 0.19): "
                "V ids, data ids 0..V-2 and EOD V-1")
    return ("--tokenizer-type NullTokenizer --vocab-size V is Megatron-LM's (megatron-core 0.16): "
            "data ids 0..V-1 plus EOD V (V + 1 ids)")


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str], vocab_size: Optional[int]):
    """The one tokenizer factory: the trainer, `data.preprocess` and `generate` all build theirs here.
    `vocab_size` is the `--vocab-size` flag (read by NullTokenizer only)."""
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        from megatron_csbp.data.tokenizer import DEFAULT_MODEL, SentencePieceTokenizer

        path = tokenizer_model or DEFAULT_MODEL
        if not os.path.exists(path):
            raise ValueError(f"--tokenizer-model {path} does not exist")
        return MegatronTokenizerAdapter(SentencePieceTokenizer(path))
    if tokenizer_type == "HuggingFaceTokenizer":
        from megatron_csbp.data.tokenizer import HuggingFaceTokenizer

        if not tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR (a local tokenizer "
                             "folder, e.g. a converted checkpoint's hf_assets)")
        return MegatronTokenizerAdapter(HuggingFaceTokenizer(tokenizer_model))
    if tokenizer_type == "NullTokenizer":
        least = 2 if null_tokenizer_counts_eod() else 1  # at least one data id
        if not vocab_size or vocab_size < least:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size V >= {least} ({null_tokenizer_rule()})")
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

        return MegatronTokenizerAdapter(NullTokenizer(int(vocab_size)), null=True)
    raise ValueError(f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}, got {tokenizer_type!r}")


def null_tokenizer_vocab_flag(vocab_size: int) -> int:
    """The `--vocab-size` whose NullTokenizer has `vocab_size` ids (EOD `vocab_size - 1`): the inverse
    of `build_tokenizer("NullTokenizer", None, V).vocab_size` (V on megatron-core 0.19, V + 1 on 0.16.1)."""
    return int(vocab_size) if null_tokenizer_counts_eod() else int(vocab_size) - 1


def saved_tokenizer(tokenizer_type: Optional[str], tokenizer_model: Optional[str], vocab_size: Optional[int]):
    """The tokenizer of a run whose tokenizer vocabulary (EOD included; the trainer's validated
    `args.vocab_size`, a checkpoint's `bdlm_meta.json` "vocab_size") is `vocab_size`: a NullTokenizer
    is rebuilt from its `--vocab-size` (`null_tokenizer_vocab_flag`), the others from their files."""
    tokenizer_type = tokenizer_type or "SentencePieceTokenizer"
    flag = null_tokenizer_vocab_flag(vocab_size) if tokenizer_type == "NullTokenizer" and vocab_size else vocab_size
    return build_tokenizer(tokenizer_type, tokenizer_model, flag)


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


class _View(torch.utils.data.Dataset):
    """A dataset seen through `__getitem__` (the subclass's)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)


class _GPTSampleView(_View):
    """Megatron's GPT/Blended dataset sample -> {tokens: its labels (text[1:]), loss_mask: Megatron's}."""

    def __getitem__(self, idx):
        sample = self.dataset[int(idx) % len(self.dataset)]
        return {"tokens": sample["labels"].long(), "loss_mask": sample["loss_mask"].to(torch.float32)}


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _blend(data_path: Sequence[str]):
    """Megatron's blend syntax: `PREFIX ...` or `W1 PREFIX1 W2 PREFIX2 ...` -> (prefixes, weights). A
    list with a weight in it that is not weight-prefix pairs is refused (Megatron reads it as prefixes)."""
    from megatron.core.datasets.utils import get_blend_from_list

    items = list(data_path)
    if len(items) > 1 and any(map(_is_number, items)) and (
            len(items) % 2 or not all(map(_is_number, items[0::2])) or any(map(_is_number, items[1::2]))):
        raise ValueError(f"--data-path {' '.join(items)}: a blend is weight-prefix pairs, W1 PREFIX1 W2 PREFIX2 ... "
                         f"(got {len(items)} values{'' if len(items) % 2 == 0 else ', an odd count'})")
    return get_blend_from_list(items)


def missing_prefixes(data_path: Sequence[str]) -> List[str]:
    """The `--data-path` prefixes whose `.bin` or `.idx` file is not here."""
    return [p for p in _blend(data_path)[0] if not all(os.path.exists(p + ext) for ext in (".bin", ".idx"))]


def parse_data_path(data_path: Sequence[str]):
    """Megatron's blend syntax: `PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...`; a clear error otherwise."""
    blend = _blend(data_path)
    for prefix in blend[0]:
        named = next((ext for ext in (".bin", ".idx") if prefix.endswith(ext)), None)
        if named and not os.path.exists(prefix + ".bin"):  # the file named, not its prefix
            raise ValueError(f"--data-path takes the prefix without .bin/.idx: did you mean {prefix[:-len(named)]}?")
        for ext in (".bin", ".idx"):
            if not os.path.exists(prefix + ext):
                raise ValueError(f"--data-path: {prefix}{ext} does not exist (expected a prefix written by "
                                 "python -m megatron_csbp.data.preprocess)")
    return blend


SPLIT_NAMES = ("training", "validation", "test")
#: splits tried, in order, when a --split leaves a split the run reads without documents
_SUGGESTED_SPLITS = ("98,2,0", "95,5,0", "90,10,0", "80,20,0", "50,50,0")


def _split_matrix(split: str):
    """Megatron's split matrix of `--split` (1 to 3 weights; missing ones are 0, as in Megatron)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)

    try:
        weights = [float(w) for w in re.findall(r"[.0-9]+", split or "")]
    except ValueError:
        weights = []
    if not re.fullmatch(r"\s*[.0-9]+(\s*[, /]\s*[.0-9]+){0,2}\s*", split or "") or not sum(weights) > 0:
        raise ValueError(f"--split {split!r} must be up to three non-negative weights train,valid,test with a "
                         "positive sum (e.g. 969,30,1)")
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def _split_documents(bookends, num_documents: int):
    """Documents [begin, end) of one split of a prefix: Megatron's own rounding
    (`BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`)."""
    if bookends is None:
        return 0, 0
    return int(round(bookends[0] * float(num_documents))), int(round(bookends[1] * float(num_documents)))


def _empty_splits(matrix, lengths: np.ndarray, read: Sequence[bool]) -> List[int]:
    """The splits the run reads that get no document (or no token) of a prefix with these document lengths."""
    return [i for i, needed in enumerate(read)
            if needed and int(lengths[slice(*_split_documents(matrix[i], len(lengths)))].sum()) == 0]


def largest_token_id(data_path: Sequence[str], vocab_size: Optional[int] = None):
    """(largest token id, its `.bin`) over every `--data-path` prefix: one pass over each `.bin`
    through a numpy memmap (the `.idx` header gives the dtype; cost: docs/training.md#data). A
    prefix whose dtype holds no id >= `vocab_size` is not read."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    best = (-1, None)
    for prefix in parse_data_path(data_path)[0]:
        dtype = IndexedDataset(prefix, multimodal=False, mmap=True).index.dtype  # from the .idx header
        if vocab_size is not None and np.issubdtype(dtype, np.integer) and np.iinfo(dtype).max < vocab_size:
            continue
        tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
        top = max((int(tokens[i:i + (1 << 26)].max()) for i in range(0, len(tokens), 1 << 26)), default=-1)
        best = max(best, (top, prefix + ".bin"), key=lambda t: t[0])
    return best


def checked_split_matrix(data_path: Sequence[str], split: str, read: Sequence[bool] = (True, True, False)):
    """Megatron's split matrix of `--split` for `--data-path`, checked before any dataset is built.

    `read[i]`: whether the run reads split i (training always; validation when it evaluates; the
    test split never). Every split it reads must get at least one document (and token) of every
    prefix: megatron-core's `GPTDataset` loops forever computing the epochs of a split that has
    samples requested but no tokens. The splits it does not read are set to None, so Megatron
    does not build them (their boundaries, and so the other splits' documents, are unchanged).
    Reads only the `.idx` files' document lengths: O(documents) per prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefixes, _ = parse_data_path(data_path)
    matrix = _split_matrix(split)
    lengths = {}
    for prefix in prefixes:
        index = IndexedDataset(prefix, multimodal=False, mmap=True)
        lengths[prefix] = np.array(index.sequence_lengths, dtype=np.int64)  # a copy: the mmap closes with `index`
        del index
    for prefix, doc_lengths in lengths.items():
        empty = _empty_splits(matrix, doc_lengths, read)
        if not empty:
            continue
        n = len(doc_lengths)
        name = SPLIT_NAMES[empty[0]]
        smallest = min(lengths.values(), key=len)
        fallback = (f"{len(smallest) - 1},1,0",) if len(smallest) > 1 else ()
        works = [c for c in _SUGGESTED_SPLITS + fallback
                 if all(not _empty_splits(_split_matrix(c), l, read) for l in lengths.values())]
        fix = (f"e.g. --split {works[0]} gives every split it reads a document" if works else
               f"{len(smallest)} document(s) cannot make a {name} split: add documents"
               + (" or set --eval-iters 0" if empty[0] == 1 else ""))
        raise ValueError(f"--split {split} gives the {name} split none of the {n} documents of --data-path {prefix} "
                         f"(split boundaries are round(fraction x {n})), and the run reads that split; {fix}")
    return [m if needed else None for m, needed in zip(matrix, read)]


def build_gpt_datasets(data_path: Sequence[str], split: str, seq_length: int, seed: int, tokenizer,
                       num_samples: Sequence[int], cache_dir: Optional[str] = None,
                       read: Sequence[bool] = (True, True, True)):
    """(train, valid, test) through Megatron's BlendedMegatronDatasetBuilder and GPTDataset; a split
    with `read[i]` False is not built (None)."""
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    blend = parse_data_path(data_path)
    matrix = checked_split_matrix(data_path, split, read)
    # add_extra_token_to_sequence: Megatron-LM's (pretrain_gpt.py); the sample is its labels
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=blend, split=split,
                              path_to_cache=cache_dir, tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
                              add_extra_token_to_sequence=True, mid_level_dataset_surplus=0.005)
    config.split_matrix = matrix  # Megatron's own boundaries, the splits not read dropped
    # Rank 0 builds the index caches first, then everybody reads them (Megatron-LM's pattern).
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    first = not distributed or dist.get_rank() == 0
    build = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True, config).build
    datasets = build() if first else None
    if distributed:
        dist.barrier()
    if not first:
        datasets = build()
    return [None if d is None else _GPTSampleView(d) for d in datasets]


def microbatch_indices(consumed_samples: int, micro: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> List[int]:
    """Global sample indices of one micro-batch: Megatron-LM's pretraining sampler arithmetic."""
    start = consumed_samples + micro * micro_batch_size * dp_size + dp_rank * micro_batch_size
    return list(range(start, start + micro_batch_size))


def collate(dataset, indices: Sequence[int], device=None) -> Dict[str, torch.Tensor]:
    """The micro-batch of the samples `indices` (global indices). A sample of T rows [T, L] (an SFT
    trajectory, `SFTDataset(trajectory_turns="all")`) gives T rows, row j of sample i indexed i * T + j."""
    samples = [dataset[i] for i in indices]
    keys = ["tokens", "loss_mask"] + (["document_ids"] if "document_ids" in samples[0] else [])  # packed SFT
    batch = {k: torch.stack([s[k] for s in samples]) for k in keys}
    index = torch.tensor(list(indices), dtype=torch.long)
    if batch["tokens"].dim() == 3:
        rows = batch["tokens"].shape[1]
        batch = {k: v.flatten(0, 1) for k, v in batch.items()}
        index = (index[:, None] * rows + torch.arange(rows)).flatten()
    batch["sample_index"] = index
    return batch if device is None else {k: v.to(device) for k, v in batch.items()}


class _MicroBatches(_View):
    """`collate` of a micro-batch's global indices (what the sampler yields)."""

    def __getitem__(self, indices):
        return collate(self.dataset, indices)


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
    return iter(torch.utils.data.DataLoader(_MicroBatches(dataset), sampler=sampler, batch_size=None,
                                            num_workers=num_workers, persistent_workers=False))
