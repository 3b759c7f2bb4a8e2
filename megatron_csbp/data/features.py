"""Captured DFlash verifier features: their capture (`prepare_features`, the verifier run over an
indexed dataset: `python -m megatron_csbp.dflash prepare-features`) and their reading
(`FeatureDataset`; `FeatureSplit`, what `--objective dflash` trains and evaluates on).

A features folder holds `meta.json` and shards `shard_00000/` ... of `features.npy` [n, L, width],
`tokens.npy`, `loss_mask.npy`, `doc_ids.npy`, memory-mapped when read.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional, Sequence

import numpy as np
import torch

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
        item = self.data[self.data_index(i)]
        names = {"tokens": "tokens", "loss_mask": "loss_mask", "document_ids": "doc_ids"}
        return {name: torch.from_numpy(item[key].astype(np.int64)) for name, key in names.items()}


# ---- capture ---------------------------------------------------------------------------------------

def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """[L] first position of each position's document segment (a change of id starts one)."""
    pos = torch.arange(doc_ids.numel())
    changed = torch.ones_like(pos, dtype=torch.bool)
    changed[1:] = doc_ids[1:] != doc_ids[:-1]
    return torch.cummax(torch.where(changed, pos, 0), dim=0).values


def load_verifier(hf_path: str, tensor_parallel: int = 1):
    """The Hugging Face causal LM in `hf_path` (a Megatron checkpoint: `dflash.verifier_hf_path`).

    `tensor_parallel` > 1 (under torchrun, the process group initialised): transformers' own tensor
    parallelism, the model's `base_model_tp_plan` over TP groups of that many consecutive ranks
    (`DistributedConfig(tp_size=T, dp_replicate_size=world / T)`; the data-parallel copies hold
    the whole TP-sharded model each). Every rank of a TP group must run the same forwards."""
    from transformers import AutoModelForCausalLM

    if tensor_parallel == 1:
        return AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_size=tensor_parallel, dp_replicate_size=dist.get_world_size() // tensor_parallel)
    return AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32, distributed_config=config).eval()


def check_verifier_tensor_parallel(tp: int, world: int, config) -> None:
    """--tensor-model-parallel-size T: T divides the number of ranks (the rest are data-parallel
    copies, each capturing its own shards), and the verifier's query and key/value heads (each TP
    rank holds whole heads); T > 1 needs a transformers TP plan for the verifier's family."""
    if tp < 1 or world % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} must be >= 1 and divide the number of ranks ({world})")
    if tp == 1:
        return
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % tp or kv % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} must divide the verifier's attention heads "
                         f"(num_attention_heads {heads}, num_key_value_heads {kv})")
    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(f"--tensor-model-parallel-size {tp}: transformers has no tensor-parallel plan for the "
                         f"verifier's model type {config.model_type!r}; use --tensor-model-parallel-size 1")


def pack_documents(prefix: str, seq_length: int, eod: Optional[int], max_sequences: Optional[int] = None):
    """Documents of a Megatron indexed dataset packed into [n, L] tokens and [n, L] document ids
    (the running document index; a document cut by a sequence end continues as a new segment)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    tokens, docs = [], []  # per document: its ids, its index repeated
    for i in range(len(ds)):
        ids = np.asarray(ds[i], dtype=np.int64)
        if eod is not None and (len(ids) == 0 or ids[-1] != eod):
            ids = np.append(ids, eod)
        tokens.append(ids)
        docs.append(np.full(len(ids), i, dtype=np.int64))
        if max_sequences is not None and sum(len(t) for t in tokens) >= (max_sequences + 1) * seq_length:
            break
    stream, doc_stream = np.concatenate(tokens), np.concatenate(docs)
    n = len(stream) // seq_length
    if max_sequences is not None:
        n = min(n, max_sequences)
    if n == 0:
        raise ValueError(f"--data-path {prefix}: {len(stream)} tokens cannot fill one sequence of --seq-length {seq_length}")
    return stream[: n * seq_length].reshape(n, seq_length), doc_stream[: n * seq_length].reshape(n, seq_length)


@torch.no_grad()
def capture_sequence(verifier, tokens: np.ndarray, doc_ids: np.ndarray, target_layer_ids: Sequence[int]) -> np.ndarray:
    """[L, len(ids) * h] hidden states after decoder layers `target_layer_ids`, each document
    segment run on its own from position 0."""

    L = len(tokens)
    starts = document_starts(torch.as_tensor(doc_ids)).numpy()
    bounds = sorted(set(starts.tolist())) + [L]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        ids = torch.as_tensor(tokens[a:b], dtype=torch.long, device=verifier.device)[None]
        out = verifier(input_ids=ids, output_hidden_states=True)
        # hidden_states[0] is the embedding output; decoder layer i's output is hidden_states[i + 1].
        # Under tensor parallelism they are whole (replicated) tensors on every rank of the TP group.
        parts.append(torch.cat([out.hidden_states[i + 1][0] for i in target_layer_ids], dim=-1).float().cpu())
    return torch.cat(parts).numpy()


def _process_group(world: int):
    """The job's process group under torchrun (initialised here if the launcher did not); None alone."""
    import torch.distributed as dist

    if world == 1:
        return None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.group.WORLD


def _feature_plan(a, meta: Dict, n: int) -> Dict:
    """Rank 0's view of --output: the refusal of mismatched flags, else meta.json written and the
    shards still to capture (those without a complete directory from an earlier run)."""
    os.makedirs(a.output, exist_ok=True)
    meta_path = os.path.join(a.output, META)
    if os.path.exists(meta_path):
        old = json.load(open(meta_path))
        for k in ("seq_length", "target_layer_ids", "num_sequences", "shard_size", "dtype", "width"):
            if old.get(k) != meta[k]:
                return {"error": f"--output {a.output} holds features with {k}={old.get(k)}, this run asks for "
                                 f"{meta[k]}: use another --output or the same flags to resume"}
    json.dump(meta, open(meta_path, "w"), indent=2)
    return {"pending": [s for s in range(-(-n // a.shard_size))
                        if not os.path.isdir(os.path.join(a.output, f"shard_{s:05d}"))]}


def prepare_features(a, hf_path: str) -> Dict:
    """Capture the features of the verifier in `hf_path` (--hf-path, or the --load checkpoint exported:
    `dflash.verifier_hf_path`) into --output (docs/dflash.md): each document of a packed
    sequence run on its own from position 0; a shard written under a temporary name and renamed
    when complete, so a rerun resumes after the last complete shard.

    Under torchrun with W ranks and --tensor-model-parallel-size T (default W): W / T data-parallel
    copies of the verifier, each tensor-parallel over T consecutive ranks (transformers' TP plan).
    Rank 0 alone reads --output (flag check, meta.json, the shards still to capture) and
    broadcasts that plan before the verifier is loaded, so every rank agrees on the shard list
    before any TP collective; copy d captures the pending shards d, d + W/T, ... and its TP rank 0
    writes them (temporary directory, renamed when complete: resumable as on one process). The
    plan is O(number of shards) on every rank."""
    from tqdm import tqdm
    from transformers import AutoConfig

    from megatron_csbp.data.megatron_data import build_tokenizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = a.tensor_model_parallel_size or world
    cfg = AutoConfig.from_pretrained(hf_path)
    check_verifier_tensor_parallel(tp, world, cfg)
    layers = int(cfg.num_hidden_layers)
    bad = [i for i in a.target_layer_ids if not 0 <= i < layers]
    if bad:
        raise ValueError(f"--target-layer-ids {bad} outside the verifier's {layers} decoder layers [0, {layers})")
    group = _process_group(world)
    rank = torch.distributed.get_rank() if group is not None else 0
    eod = a.eod_token_id
    if eod is None and a.tokenizer_model is not None:
        eod = build_tokenizer("SentencePieceTokenizer", a.tokenizer_model, None).eod
    tokens, doc_ids = pack_documents(a.data_path, a.seq_length, eod, a.max_sequences)
    n, L = tokens.shape
    width = len(a.target_layer_ids) * int(cfg.hidden_size)
    meta = {"format": FEATURE_FORMAT, "seq_length": L, "hidden_size": int(cfg.hidden_size),
            "target_layer_ids": list(a.target_layer_ids), "num_sequences": n, "shard_size": a.shard_size,
            "dtype": a.dtype, "verifier": a.hf_path or a.load, "width": width}
    plan = [None]
    if rank == 0:
        try:
            plan = [_feature_plan(a, meta, n)]
        except (OSError, ValueError) as exc:  # an unwritable --output or a corrupt meta.json: told to every rank
            plan = [{"error": f"--output {a.output}: {exc}"}]
    if group is not None:
        torch.distributed.broadcast_object_list(plan, src=0)
    plan = plan[0]
    if "error" in plan:
        raise ValueError(plan["error"])
    copies, copy, tp_rank = world // tp, rank // tp, rank % tp
    mine = plan["pending"][copy::copies]
    verifier = load_verifier(hf_path, tensor_parallel=tp)
    if tp == 1 and world > 1 and torch.cuda.is_available():
        verifier.to(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    done = 0
    total = n - sum(min(a.shard_size, n - s * a.shard_size) for s in plan["pending"] if s not in mine)
    with tqdm(total=total, desc="features", unit="seq", disable=a.no_progress_bar or rank != 0) as bar:
        bar.update(total - sum(min(a.shard_size, n - s * a.shard_size) for s in mine))  # complete before
        for s in mine:
            start, stop = s * a.shard_size, min((s + 1) * a.shard_size, n)
            final = os.path.join(a.output, f"shard_{s:05d}")
            tmp, feats = final + ".tmp", None
            if tp_rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
                feats = np.lib.format.open_memmap(os.path.join(tmp, "features.npy"), mode="w+", dtype=a.dtype,
                                                  shape=(stop - start, L, width))
            for i in range(start, stop):
                row = capture_sequence(verifier, tokens[i], doc_ids[i], a.target_layer_ids)
                if feats is not None:
                    feats[i - start] = row
                bar.update(1)
            if tp_rank == 0:
                feats.flush()
                del feats
                np.save(os.path.join(tmp, "tokens.npy"), tokens[start:stop].astype(np.int32))
                np.save(os.path.join(tmp, "loss_mask.npy"), np.ones((stop - start, L), dtype=np.uint8))
                np.save(os.path.join(tmp, "doc_ids.npy"), doc_ids[start:stop].astype(np.int32))
                os.replace(tmp, final)
            done += stop - start
    if group is not None:  # every copy's shards are complete before any rank returns
        device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        count = torch.tensor([done if tp_rank == 0 else 0], dtype=torch.long, device=device)
        torch.distributed.all_reduce(count)
        done = int(count.item())
    return {"sequences": n, "captured_now": done, "output": a.output}
