"""The converter's operations as functions (the CLI in `megatron_csbp.convert` wraps them)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from megatron_csbp.checkpoint.files import ASSETS_DIR, read_checkpoint_model
from megatron_csbp.checkpoint.model import (
    load_checkpoint_model, load_model_weights, save_gpt_model, single_process_megatron,
)
from megatron_csbp.conversion import hf_io
from megatron_csbp.model.builder import build_gpt_model
from megatron_csbp.model.families.gpt_weights import cast
from megatron_csbp.model.families import DTYPES, ModelShape, get_family, megatron_flags, shape_from_hf_config


#: Hugging Face tensors of a diffusion_gemma checkpoint with no Megatron counterpart (the vision
#: tower), kept in the checkpoint's `hf_assets/` (which the trainer copies into every checkpoint it
#: saves) so that the export writes them back.
EXTRA_WEIGHTS_FILE = "hf_extra_weights.safetensors"


def hf_to_megatron_checkpoint(hf_path: str, output: str, dtype: Optional[str] = None) -> ModelShape:
    """Convert a Hugging Face folder into a Megatron torch_dist release checkpoint."""
    cfg = hf_io.read_config(hf_path)
    shape = shape_from_hf_config(cfg, params_dtype=dtype)  # refuses unsupported models first
    tensors = hf_io.read_tensors(hf_path)
    state, extra = get_family(shape.family).hf_to_megatron(shape, tensors, cfg)
    state = cast(state, shape.torch_dtype)
    with single_process_megatron():
        model = build_gpt_model(shape)
        load_model_weights(model, state)
        save_gpt_model(model, shape, output)
    hf_io.copy_assets(hf_path, os.path.join(output, ASSETS_DIR))
    if extra:
        save_file({k: v.contiguous() for k, v in extra.items()}, os.path.join(output, ASSETS_DIR, EXTRA_WEIGHTS_FILE))
    return shape


def megatron_to_hf_checkpoint(load: str, output: str, dtype: Optional[str] = None,
                              max_shard_bytes: int = 5 << 30, tokenizer_model: Optional[str] = None,
                              log: Optional[Callable[[str], None]] = None,
                              transform: Optional[Callable[[dict], dict]] = None) -> ModelShape:
    """Export a Megatron checkpoint (converted or trained, flag-built or not, saved under any
    layout) to Hugging Face, with the tokenizer it was trained with (`conversion.tokenizer`;
    `tokenizer_model` overrides where it is read from). `log` receives one line on the tokenizer.
    `transform` maps the unsharded state before the export (a LoRA merge)."""
    from megatron_csbp.conversion.tokenizer import checkpoint_tokenizer, export_tokenizer

    info = read_checkpoint_model(load)  # refuses a model with no Hugging Face class before any work
    checkpoint_tokenizer(info.model_args, tokenizer_model, info.assets_dir)  # a missing tokenizer: refused first
    with single_process_megatron():
        model, _ = load_checkpoint_model(info)
        state = model.state_dict()
    state = transform(state) if transform is not None else state
    shape, family = info.shape, get_family(info.shape.family)
    out_dtype = dtype or shape.params_dtype
    if out_dtype not in DTYPES:
        raise ValueError(f"--dtype {out_dtype!r} is not one of {sorted(DTYPES)}")
    cfg, tensors, skip_assets = family.megatron_to_hf(shape, state)
    tensors = cast(tensors, DTYPES[out_dtype])
    extra_file = os.path.join(info.assets_dir, EXTRA_WEIGHTS_FILE)
    if family.carries_extra_weights and os.path.isfile(extra_file):  # HF tensors carried through unchanged
        tensors.update(load_file(extra_file))
    hf_io.write_tensors(output, tensors, max_shard_bytes)
    if os.path.isdir(info.assets_dir):
        hf_io.copy_assets(info.assets_dir, output, exclude=skip_assets)
    cfg.update(dtype=out_dtype, **({"torch_dtype": out_dtype} if "torch_dtype" in cfg else {}))
    if isinstance(cfg.get("text_config"), dict) and cfg["text_config"].get("dtype") is not None:
        cfg["text_config"] = dict(cfg["text_config"], dtype=out_dtype)
    Path(output, "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    line = export_tokenizer(info.model_args, output, tokenizer_model, info.assets_dir)
    if log is not None:
        log(line)
    return shape


def one_rank_model(model, objective, packing, *geometry):
    """`model` in the block-diffusion wrapper on one rank (any length), its layout of `BlockGeometry(*geometry)`."""
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel

    return BlockDiffusionModel(model, objective, SequenceLayout(BlockGeometry(*geometry)), packing=packing)


class ARScorer:
    """Next-token logits [batch, seq, vocab] of a model for sequences of one length: the AR
    objective's clean, token-causal stream through the block-diffusion wrapper (the same path the
    trainer's `--objective ar` takes)."""

    def __init__(self, model, seq_length: int, packing=None):
        from megatron_csbp.objectives.ar import AutoregressiveObjective

        self.seq_length = seq_length
        self.bdlm = one_rank_model(model, AutoregressiveObjective(), packing, seq_length, seq_length)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] != self.seq_length:
            raise ValueError(f"tokens have length {tokens.shape[1]}, the scorer was built for {self.seq_length}")
        return packed_logits(self.bdlm, tokens, self.bdlm.plan, tokens)


class BlockDiffusionScorer:
    """Logits [batch, L - P, vocab] of the noisy rows after a prompt of P tokens: the training
    forward over [noisy ; clean] rows, where noisy block b sees the clean tokens before it and its
    own block (bidirectionally). Prompt blocks get no noisy copy (as in DiffusionGemma SFT)."""

    def __init__(self, model, seq_length: int, block_size: int, prompt_length: int = 0,
                 clean_attention: str = "block_causal", packing=None):
        from megatron_csbp.objectives import BD3LMObjective

        if block_size <= 0 or seq_length % block_size:
            raise ValueError(f"--block-size {block_size} must divide the sequence length {seq_length}")
        if not 0 <= prompt_length < seq_length or prompt_length % block_size:
            raise ValueError(f"--prompt-length {prompt_length} must be a multiple of --block-size {block_size} "
                             f"below the sequence length {seq_length} (noisy blocks start on block boundaries)")
        self.seq_length, self.prompt_length = seq_length, prompt_length
        # Logits only: the objective's noise and loss are never used here.
        self.bdlm = one_rank_model(model, BD3LMObjective(block_size, mask_token_id=0), packing, seq_length, block_size,
                                   clean_attention)
        self.plan = self.bdlm.canvas_plan(prompt_length // block_size)
        rows = self.plan.local
        self.noisy_positions = rows.position[~rows.is_clean]
        assert int(self.noisy_positions.min()) == prompt_length and len(self.noisy_positions) == seq_length - prompt_length

    def __call__(self, clean: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
        rows = self.plan.local
        ids = torch.where(rows.is_clean[None], clean[:, rows.position], noisy[:, rows.position])
        logits = packed_logits(self.bdlm, ids, self.plan, clean)
        out = torch.empty_like(logits)
        out[:, self.noisy_positions - self.prompt_length] = logits
        return out


def packed_logits(bdlm, ids: torch.Tensor, plan, clean: torch.Tensor) -> torch.Tensor:
    """`bdlm.logits(ids, plan)`, or with the model's packing each sequence under its own
    documents (read from its clean tokens `clean` [b, L])."""
    if bdlm.packing is None or not bdlm.packing.splits_documents:
        return bdlm.logits(ids, plan)
    return torch.cat([bdlm.logits(ids[i:i + 1], bdlm.packing.plan(plan, clean[i])) for i in range(ids.shape[0])])


def _check_ids(name: str, ids: np.ndarray, vocab_size: int) -> None:
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array [batch, seq], got {ids.dtype} {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name}: token ids must lie in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")


def score(load: str, tokens: np.ndarray, batch_size: int = 8, noisy_tokens: Optional[np.ndarray] = None,
          block_size: Optional[int] = None, prompt_length: int = 0,
          clean_attention: Optional[str] = None, packing=None) -> np.ndarray:
    """float32 logits of the checkpoint for int token ids [batch, seq].

    Without `noisy_tokens`: next-token logits [batch, seq, vocab] (the clean, token-causal stream).
    With `noisy_tokens` ([batch, seq], or [batch, seq - P]) and `block_size`: the block-diffusion
    logits of the noisy rows after the prompt, [batch, seq - P, vocab]. The clean stream is
    token-causal for DiffusionGemma, `clean_attention` (default block_causal, the trainer's
    default) otherwise. `packing` (`layout.packing.Packing`: --reset-attention-mask,
    --reset-position-ids with --eod-token-id): each sequence's EOD-delimited documents are scored
    apart, as in training."""
    from megatron_csbp.generation.lora import fold_adapters, read_lora

    tokens = np.asarray(tokens)
    lora = read_lora(load)  # a LoRA checkpoint: its base with the adapters folded in
    info = read_checkpoint_model(lora[2] if lora else load)
    shape = info.shape
    _check_ids("--tokens", tokens, shape.vocab_size)
    if noisy_tokens is not None:
        noisy_tokens = np.asarray(noisy_tokens)
        if block_size is None:
            raise ValueError("--noisy-tokens needs --block-size")
        _check_ids("--noisy-tokens", noisy_tokens, shape.vocab_size)
        L, P = tokens.shape[1], prompt_length
        if noisy_tokens.shape == (tokens.shape[0], L - P) and P:
            noisy_tokens = np.concatenate([tokens[:, :P], noisy_tokens], axis=1)
        if noisy_tokens.shape != tokens.shape:
            raise ValueError(f"--noisy-tokens has shape {noisy_tokens.shape}; it must be {tokens.shape} (like --tokens) "
                             f"or {(tokens.shape[0], L - P)} (the rows after --prompt-length)")
        forced = get_family(shape.family).clean_attention
        if forced is not None:
            if clean_attention not in (None, forced):
                raise ValueError(f"{shape.family}'s clean stream is {forced.replace('_', '-')}: "
                                 f"--clean-attention {forced}")
            clean_attention = forced
    elif block_size is not None or prompt_length:
        raise ValueError("--block-size / --prompt-length score noisy rows: give --noisy-tokens too")
    out = []
    with single_process_megatron():
        model, _ = load_checkpoint_model(info, params_dtype=torch.float32)
        if lora:
            fold_adapters(model, *lora[:2])
        model.eval()
        if noisy_tokens is None:
            scorer = ARScorer(model, tokens.shape[1], packing)
        else:
            scorer = BlockDiffusionScorer(model, tokens.shape[1], block_size, prompt_length,
                                          clean_attention or "block_causal", packing)
        with torch.no_grad():
            for start in range(0, tokens.shape[0], batch_size):
                inputs = [torch.from_numpy(ids[start:start + batch_size].astype(np.int64))
                          for ids in (tokens, noisy_tokens) if ids is not None]  # (clean[, noisy])
                out.append(scorer(*inputs).float().numpy())
    rows = tokens.shape[1] - (prompt_length if noisy_tokens is not None else 0)
    return np.concatenate(out, axis=0) if out else np.zeros((0, rows, shape.vocab_size), np.float32)


def flags_text(shape: ModelShape) -> str:
    return " \\\n    ".join(megatron_flags(shape))
