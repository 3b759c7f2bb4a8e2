"""`python -m megatron_csbp.dflash {prepare-features,train,export,evaluate}`: DFlash drafters.

- `prepare-features`: runs a verifier (`--hf-path` Hugging Face checkpoint, or `--load` a Megatron
  checkpoint this project converted or trained) over an indexed dataset (`--data-path PREFIX`,
  documents packed into `--seq-length` sequences) and writes, per shard of `--shard-size`
  sequences, memory-mapped `features.npy` [n, L, len(target_layer_ids) * hidden] (the verifier's
  hidden states after the listed decoder layers, 0-based, concatenated), `tokens.npy`,
  `loss_mask.npy` and `doc_ids.npy`. The verifier runs each document of a packed sequence on its
  own, from position 0, as it does when decoding. A shard is written under a temporary name and
  renamed when complete: rerunning the command resumes after the last complete shard. Under
  torchrun the verifier is tensor-parallel over `--tensor-model-parallel-size` ranks (default: all)
  with transformers' own TP plan; the remaining factor of the ranks captures disjoint shards.
- `train`: trains a `muse_glimmer_assistant` drafter (megatron_csbp.model.dflash) on those
  features with `--objective dflash` semantics (megatron_csbp.objectives.dflash) under any of
  single / CP / BP / CSBP (`--context-parallel-size`, `--block-parallel-size`; launch with
  torchrun, gloo on CPU); the verifier's embeddings and LM head are read from `--verifier`, frozen.
- `export`: a trained drafter checkpoint -> Hugging Face `MuseGlimmerAssistantModel` directory.
- `evaluate`: transformers' own DFlash decoding (`generate(..., assistant_model=drafter)`,
  `speculation_type="dflash"`) against the verifier alone on held-out documents: checks the greedy
  outputs are identical and reports the mean tokens per verifier step and per drafting step (the
  measured acceptance length), beside the training-time estimator on the same documents (the
  verifier's greedy outputs, serving's anchors) and the bound docs/dflash.md derives between them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron_csbp.data.features import FEATURE_FORMAT, META, FeatureDataset  # noqa: F401 (FeatureDataset: this CLI's API)
from megatron_csbp.utils.cli import ArgumentParser, run



# ---- feature capture -----------------------------------------------------------------------------

def verifier_hf_path(hf_path: Optional[str] = None, load: Optional[str] = None) -> str:
    """The verifier as a Hugging Face directory: `hf_path`, or the Megatron checkpoint `load`
    exported to a temporary directory (process-local: under torchrun every rank exports its own
    copy, so no shared file system is assumed)."""
    if (hf_path is None) == (load is None):
        raise ValueError("give the verifier as --hf-path (Hugging Face) or --load (Megatron checkpoint), one of them")
    if load is None:
        return hf_path
    import tempfile

    from megatron_csbp.conversion.api import megatron_to_hf_checkpoint

    tmp = tempfile.mkdtemp(prefix="verifier_hf_")
    megatron_to_hf_checkpoint(load, tmp, dtype="float32")
    return tmp


def load_verifier(hf_path: Optional[str] = None, load: Optional[str] = None, dtype=torch.float32,
                  tensor_parallel: int = 1):
    """A Hugging Face causal LM: from `hf_path`, or exported from the Megatron checkpoint `load`.

    `tensor_parallel` > 1 (under torchrun, the process group initialised): transformers' own tensor
    parallelism, the model's `base_model_tp_plan` over TP groups of that many consecutive ranks
    (`DistributedConfig(tp_size=T, dp_replicate_size=world / T)`; the data-parallel copies hold
    the whole TP-sharded model each). Every rank of a TP group must run the same forwards."""
    from transformers import AutoModelForCausalLM

    hf_path = verifier_hf_path(hf_path, load)
    if tensor_parallel == 1:
        return AutoModelForCausalLM.from_pretrained(hf_path, dtype=dtype).eval()
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    world = dist.get_world_size()
    config = DistributedConfig(tp_size=tensor_parallel, dp_replicate_size=world // tensor_parallel)
    return AutoModelForCausalLM.from_pretrained(hf_path, dtype=dtype, distributed_config=config).eval()


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
    tokens: List[np.ndarray] = []
    docs: List[np.ndarray] = []
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
    from megatron_csbp.objectives.dflash import document_starts

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
    shards = list(range(-(-n // a.shard_size)))
    return {"pending": [s for s in shards if not os.path.isdir(os.path.join(a.output, f"shard_{s:05d}"))]}


def prepare_features(a) -> Dict:
    """Capture the verifier's features into --output (see the module docstring).

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
    hf_path = verifier_hf_path(a.hf_path, a.load)
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
    dtype = np.float16 if a.dtype == "float16" else np.float32
    done = 0
    total = n - sum(min(a.shard_size, n - s * a.shard_size) for s in plan["pending"] if s not in mine)
    with tqdm(total=total, desc="features", unit="seq", disable=a.no_progress_bar or rank != 0) as bar:
        bar.update(total - sum(min(a.shard_size, n - s * a.shard_size) for s in mine))  # complete before
        for s in mine:
            final = os.path.join(a.output, f"shard_{s:05d}")
            start = s * a.shard_size
            stop = min(start + a.shard_size, n)
            tmp = final + ".tmp"
            feats = None
            if tp_rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
                feats = np.lib.format.open_memmap(os.path.join(tmp, "features.npy"), mode="w+", dtype=dtype,
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


# ---- evaluation ---------------------------------------------------------------------------------

@torch.no_grad()
def training_acceptance(model, data, first: int, shard_group=None):
    """The drafter's training-time acceptance on the held-out sequences data[first:]: per-offset
    accuracy and expected acceptance length (`objectives.dflash.acceptance_from_counts`) over the
    objective's anchors of each sequence (the training forward, this layout; counts summed over the
    shard group; every data-parallel replica evaluates all of them)."""
    import torch.distributed as dist

    from megatron_csbp.objectives.dflash import acceptance_from_counts

    counts = None
    for index in range(first, len(data)):
        item = data[index]
        out = model(item["features"], torch.from_numpy(item["tokens"].astype(np.int64)),
                    torch.from_numpy(item["loss_mask"].astype(np.int64)),
                    torch.from_numpy(item["doc_ids"].astype(np.int64)), sample_index=index, with_acceptance=True)
        c = out.metrics["acceptance_counts"]
        counts = c if counts is None else counts + c
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        dist.all_reduce(counts, group=shard_group)
    return acceptance_from_counts(counts)


def load_drafter(path: str):
    from megatron_csbp.model.dflash import DFlashDrafter, DrafterShape

    shape = DrafterShape.from_json(open(os.path.join(path, "megatron_csbp_drafter.json")).read())
    model = DFlashDrafter(shape)
    state = torch.load(os.path.join(path, "drafter.pt"), map_location="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"drafter checkpoint {path}: missing {missing}, unexpected {unexpected}")
    return model


def export(a) -> str:
    """The drafter as a Hugging Face folder, with its verifier's tokenizer (prints what it wrote)."""
    from megatron_csbp.conversion.drafter import megatron_to_hf_drafter

    megatron_to_hf_drafter(a.load, a.output, tokenizer_model=getattr(a, "tokenizer_model", None), log=print)
    return a.output


# ---- evaluation with transformers' DFlash decoding -----------------------------------------------

@torch.no_grad()
def evaluate(verifier, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Dict:
    """Greedy decoding of each prompt by the verifier alone and with the drafter through
    transformers' DFlash candidate generator. Returns identical (all outputs equal), the mean
    tokens per verifier step (new tokens / verifier forwards, prefill included), the drafting steps
    (drafter forwards) and the measured acceptance length: tokens per drafting step,
    (new tokens - verifier steps + drafting steps) / drafting steps (the prefill and the final
    verifier-only step, when one token is left, each yield one token and draft nothing), and
    `outputs`, the greedy outputs (prompt + new tokens, one list per prompt)."""
    from transformers import GenerationConfig

    calls = {"n": 0, "draft": 0}
    hook = verifier.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    draft_hook = drafter.register_forward_pre_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1))
    identical, tokens, steps, plain_steps, drafts, outputs = True, 0, 0, 0, 0, []
    spec = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, speculation_type="dflash",
                            pad_token_id=None, eos_token_id=None)
    plain = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=None, eos_token_id=None)
    try:
        for prompt in prompts:
            ids = torch.as_tensor(prompt, dtype=torch.long)[None]
            calls["n"] = 0
            ref = verifier.generate(ids, generation_config=plain)
            plain_steps += calls["n"]
            calls["n"], calls["draft"] = 0, 0
            out = verifier.generate(ids, generation_config=spec, assistant_model=drafter)
            steps += calls["n"]
            drafts += calls["draft"]
            identical &= bool(torch.equal(out, ref))
            tokens += out.shape[1] - ids.shape[1]
            outputs.append(ref[0].tolist())
    finally:
        hook.remove()
        draft_hook.remove()
    return {"identical": identical, "prompts": len(prompts), "new_tokens": tokens, "verifier_steps": steps,
            "verifier_steps_alone": plain_steps, "tokens_per_step": tokens / max(steps, 1), "drafting_steps": drafts,
            "measured_acceptance_length": (tokens - steps + drafts) / max(drafts, 1), "outputs": outputs}


def evaluate_cli(a) -> Dict:
    from transformers import MuseGlimmerAssistantModel

    verifier = load_verifier(a.verifier)
    drafter = MuseGlimmerAssistantModel.from_pretrained(a.drafter, dtype=torch.float32).eval()
    prompts = []
    if a.prompts_data_path:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        docs = IndexedDataset(a.prompts_data_path)
        for i in range(len(docs) - 1, -1, -1):  # the last documents with a full prompt
            if len(prompts) == a.eval_sequences:
                break
            ids = np.asarray(docs[i], dtype=np.int64)
            if len(ids) > a.prompt_length:
                prompts.append(ids[: a.prompt_length].tolist())
    else:
        data = FeatureDataset(a.features_path)
        for i in range(len(data) - a.eval_sequences, len(data)):
            prompts.append(data[i]["tokens"][: a.prompt_length].astype(np.int64).tolist())
    result = evaluate(verifier, drafter, prompts, a.max_new_tokens)
    # the training-time estimator on the same documents: the verifier's greedy outputs, serving's anchors
    result.update(serving_estimate(verifier, drafter, prompts, result.pop("outputs"), a.logit_tolerance))
    if a.features_path:  # the estimate as training logs it, on the held-out captured sequences
        result.update(training_estimate(a, verifier, drafter))
    print(json.dumps(result, indent=1))
    return result


def training_estimate(a, verifier, hf_drafter) -> Dict:
    """The training-time per-offset accuracy and expected acceptance length of the Hugging Face
    drafter on the held-out captured sequences (the last --eval-sequences): imported into the
    Megatron drafter and run by the training forward (one rank), the objective's anchors, the
    data's tokens as targets (see docs/dflash.md for why it differs from the measured length)."""
    from megatron_csbp.conversion.checkpoint import single_process_megatron
    from megatron_csbp.layout.dflash import DFlashLayout
    from megatron_csbp.model.dflash import DFlashTrainingModel
    from megatron_csbp.objectives.dflash import DFlashObjective

    data = FeatureDataset(a.features_path)
    with single_process_megatron():
        drafter, shape = _import_drafter(hf_drafter)
        objective = DFlashObjective(shape.block_size, shape.mask_token_id)
        L = data.meta["seq_length"]
        model = DFlashTrainingModel(drafter, verifier.get_input_embeddings().weight.detach().float(),
                                    verifier.get_output_embeddings().weight.detach().float(), objective,
                                    DFlashLayout(L, shape.block_size))
        acc, tau = training_acceptance(model, data, len(data) - a.eval_sequences)
    return {"training_acceptance_per_offset": acc, "training_expected_acceptance_length": tau}


def _import_drafter(hf_drafter):
    """(the Hugging Face drafter imported into the Megatron drafter, its DrafterShape)."""
    from megatron_csbp.model.dflash import DFlashDrafter, DrafterShape, load_hf_drafter

    shape = DrafterShape.from_hf_config(hf_drafter.config.to_dict())
    drafter = DFlashDrafter(shape)
    load_hf_drafter(drafter, hf_drafter)
    return drafter, shape


@torch.no_grad()
def serving_estimate(verifier, hf_drafter, prompts, outputs, logit_tolerance: float = 1e-3) -> Dict:
    """The training-time estimator (`objectives.dflash.acceptance_counts` / `acceptance_from_counts`,
    the training forward of the Hugging Face drafter imported into the Megatron drafter, one rank)
    on the documents serving decodes: each prompt's verifier greedy output y as the sequence (its
    features captured as `prepare-features` does), targets y (the verifier's own tokens), a block
    at every position of the continuation, and the estimate summed over the blocks serving visits
    (`objectives.dflash.serving_replay` of the drafter's right runs). docs/dflash.md derives the
    bound it returns on the measured acceptance length (tokens per drafting step):
    [tau - (C + sum_c (B - 1 - r_c)) / D, tau - C / D] (D drafting blocks, C of them cut at r_c
    tokens by --max-new-tokens), valid when no deciding slot has a top-2 logit margin within
    2 eps, eps = logit_tolerance x max(1, max |logit|) (the numeric gap between this forward and
    serving's); otherwise a relaxation over the tokens left after each prompt's first uncertain
    block (docs/dflash.md)."""
    from megatron_csbp.conversion.checkpoint import single_process_megatron
    from megatron_csbp.layout.dflash import DFlashLayout
    from megatron_csbp.model.dflash import DFlashTrainingModel
    from megatron_csbp.objectives.dflash import (DFlashObjective, acceptance_counts, acceptance_from_counts,
                                                 serving_replay)

    embedding = verifier.get_input_embeddings().weight.detach().float()
    head = verifier.get_output_embeddings().weight.detach().float()
    counts, steps, drafting, cut, uncertain, min_margin = None, 0, 0, [], 0, float("inf")
    sure_tokens, sure_steps, left = 0, 0, []
    with single_process_megatron():
        drafter, shape = _import_drafter(hf_drafter)
        B = shape.block_size
        for prompt, y in zip(prompts, outputs):
            P, L = len(prompt), len(y)
            N = L - P
            if N < 2:  # the prefill step alone: nothing drafted
                steps += N
                continue
            tokens = torch.as_tensor(y, dtype=torch.long)
            feats = capture_sequence(verifier, np.asarray(y), np.zeros(L, dtype=np.int64), shape.target_layer_ids)
            # every position of the continuation is an anchor (max_anchors >= L: all valid ones drawn)
            objective = DFlashObjective(B, shape.mask_token_id, max_anchors=L)
            model = DFlashTrainingModel(drafter, embedding, head, objective, DFlashLayout(L, B))
            loss_mask = (torch.arange(L) >= P).long()
            blocks = model(torch.from_numpy(feats), tokens, loss_mask, with_acceptance=True
                           ).metrics["acceptance_blocks"]
            if blocks["anchors"].tolist() != list(range(P, L - 1)):
                raise RuntimeError(f"expected a block at every anchor {P}..{L - 2}, got {blocks['anchors'].tolist()}")
            right = blocks["right"][:, 1:].long()
            runs = right.cumprod(dim=1).sum(dim=1)
            replay = serving_replay(runs.tolist(), P, N, B)
            v = torch.tensor(replay["visited"], dtype=torch.long)
            if len(v):
                c = acceptance_counts(blocks["right"][v], blocks["supervised"][v])
                counts = c if counts is None else counts + c
                # deciding slots: the right run and the first wrong supervised slot after it
                slot = torch.arange(1, B)
                deciding = (slot[None, :] <= runs[v, None] + 1) & blocks["supervised"][v][:, 1:]
                eps = logit_tolerance * blocks["scale"][v][:, 1:].clamp_min(1.0)
                margin = blocks["margin"][v][:, 1:]
                risky = (deciding & (margin <= 2 * eps)).any(dim=1)
                uncertain += int((deciding & (margin <= 2 * eps)).sum())
                if deciding.any():
                    min_margin = min(min_margin, float((margin / eps)[deciding].min()))
                # the blocks up to the first one with an uncertain slot are serving's for sure; from it on,
                # R = the tokens left go in d drafting steps (T_u in {R - 1, R} tokens, ceil((R - 1) / B) <= d <= R)
                j = int(risky.nonzero()[0]) if risky.any() else len(v)
                sure_tokens += sum(replay["tokens"][:j])
                sure_steps += j
                if j < len(v):
                    left.append(replay["left"][j])
            steps += replay["verifier_steps"]
            drafting += replay["drafting_steps"]
            cut += replay["cut"]
    if counts is None:
        return {"serving_estimate_drafting_blocks": 0}
    acc, tau = acceptance_from_counts(counts)
    D, C = drafting, len(cut)
    censored = [tau - (C + sum(B - 1 - r for r in cut)) / D, tau - C / D]  # no argmax flips
    if uncertain:  # a relaxation over the tokens left after each prompt's first uncertain block
        bound = [max(1.0, (sure_tokens + sum(r - 1 for r in left)) / (sure_steps + sum(left))),
                 min(float(B), (sure_tokens + sum(left)) / (sure_steps + sum(-(-(r - 1) // B) for r in left)))]
    else:
        bound = censored
    return {"serving_acceptance_per_offset": acc, "serving_expected_acceptance_length": tau,
            "serving_estimate_drafting_blocks": D, "serving_estimate_cut_blocks": C,
            "serving_estimate_verifier_steps": steps, "measured_acceptance_length_bound": bound,
            "measured_acceptance_length_bound_without_flips": censored,
            "uncertain_slots": uncertain, "min_margin_over_eps": min_margin, "logit_tolerance": logit_tolerance}


# ---- command line --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_csbp.dflash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("prepare-features", help="capture verifier hidden states over an indexed dataset")
    f.add_argument("--hf-path", default=None, help="verifier: Hugging Face checkpoint directory")
    f.add_argument("--load", default=None, help="verifier: Megatron checkpoint converted or trained here")
    f.add_argument("--data-path", required=True, help="Megatron indexed dataset prefix (PREFIX.bin / PREFIX.idx)")
    f.add_argument("--seq-length", type=int, required=True)
    f.add_argument("--target-layer-ids", type=int, nargs="+", required=True, help="0-based verifier decoder layers")
    f.add_argument("--output", required=True)
    f.add_argument("--shard-size", type=int, default=256, help="sequences per shard")
    f.add_argument("--max-sequences", type=int, default=None)
    f.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    f.add_argument("--eod-token-id", type=int, default=None, help="appended to documents that lack it")
    f.add_argument("--tokenizer-model", default=None, help="sentencepiece model whose EOD is appended")
    f.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="under torchrun: the verifier tensor-parallel over this many ranks (transformers' TP plan; "
                        "must divide the number of ranks and the verifier's attention heads), the remaining "
                        "factor capturing disjoint shards; default: all ranks")
    f.add_argument("--no-progress-bar", action="store_true")

    sub.add_parser("train", add_help=False, help="train a drafter: python -m megatron_csbp.train --objective dflash "
                   "(this subcommand hands its flags over, with its older defaults)")
    e = sub.add_parser("export", help="drafter checkpoint -> Hugging Face MuseGlimmerAssistantModel")
    e.add_argument("--load", required=True)
    e.add_argument("--output", required=True)
    e.add_argument("--tokenizer-model", default=None,
                   help="the verifier's tokenizer folder (default: the one the drafter's checkpoint recorded)")

    v = sub.add_parser("evaluate", help="transformers' DFlash decoding vs the verifier alone, held-out prompts")
    v.add_argument("--verifier", required=True)
    v.add_argument("--drafter", required=True, help="exported Hugging Face drafter")
    v.add_argument("--features-path", default=None, help="prompts: the last --eval-sequences captured sequences")
    v.add_argument("--prompts-data-path", default=None,
                   help="prompts instead from the last --eval-sequences documents of this indexed dataset")
    v.add_argument("--eval-sequences", type=int, default=8)
    v.add_argument("--prompt-length", type=int, default=32)
    v.add_argument("--max-new-tokens", type=int, default=48)
    v.add_argument("--logit-tolerance", type=float, default=1e-3,
                   help="relative bound on the logit gap between the estimate's drafter forward and serving's "
                        "(eps = this x max(1, max |logit|)); slots with a top-2 margin within 2 eps are uncertain")
    return p


def check_args(a) -> None:
    if a.command == "prepare-features":
        if a.seq_length <= 0 or a.shard_size <= 0:
            raise ValueError("--seq-length and --shard-size must be positive")
    if a.command == "evaluate" and not (a.features_path or a.prompts_data_path):
        raise ValueError("evaluate needs --features-path or --prompts-data-path (where the prompts come from)")
    if a.command == "evaluate" and not a.logit_tolerance > 0:
        raise ValueError(f"--logit-tolerance must be > 0, got {a.logit_tolerance}")
    if a.command == "evaluate" and a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")


#: `dflash train`'s defaults where the trainer's differ (architecture ones only without --load:
#: a loaded drafter's shape decides those)
TRAIN_DEFAULTS = ["--lr", "3e-3", "--train-iters", "100", "--weight-decay", "0", "--adam-beta2", "0.95",
                  "--micro-batch-size", "1", "--log-interval", "10", "--lr-decay-style", "constant"]
ARCHITECTURE_DEFAULTS = ["--num-layers", "1", "--block-size", "8"]


def train_parser():
    """What `dflash train` accepts: the trainer's parser (`--objective dflash`)."""
    from megatron_csbp.training.arguments import build_parser as trainer_parser

    return trainer_parser()


def train(argv: Sequence[str]):
    """`dflash train ...`: `python -m megatron_csbp.train --objective dflash ...` (the `Trainer`)."""
    from megatron_csbp.training.loop import main as train_main

    argv = list(argv)
    defaults = TRAIN_DEFAULTS + ([] if "--load" in argv else ARCHITECTURE_DEFAULTS)
    return train_main(defaults + ["--objective", "dflash"] + argv)


def main(argv: Optional[Sequence[str]] = None):
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return train(argv[1:])
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        check_args(a)
    except ValueError as exc:
        parser.error(str(exc))
    if a.command == "prepare-features":
        result = prepare_features(a)
        print(json.dumps(result))
        return result
    if a.command == "export":
        print(export(a))
        return a.output
    return evaluate_cli(a)


if __name__ == "__main__":
    sys.exit(run(main))
