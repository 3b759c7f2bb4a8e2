"""The converter's operations as functions (the CLI in `megatron_csbp.convert` wraps them)."""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np
import torch

from megatron_csbp.conversion import hf_io
from megatron_csbp.conversion.checkpoint import (
    ASSETS_DIR, load_gpt_model, load_model_weights, read_shape, save_gpt_model, single_process_megatron,
)
from megatron_csbp.conversion.mapping import cast, hf_to_megatron, megatron_to_hf
from megatron_csbp.model.providers import DTYPES, ModelShape, build_gpt_model, megatron_flags, shape_from_hf_config


def hf_to_megatron_checkpoint(hf_path: str, output: str, dtype: Optional[str] = None) -> ModelShape:
    """Convert a Hugging Face folder into a Megatron torch_dist release checkpoint."""
    cfg = hf_io.read_config(hf_path)
    shape = shape_from_hf_config(cfg, params_dtype=dtype)  # refuses unsupported models first
    tensors = hf_io.read_tensors(hf_path)
    state = cast(hf_to_megatron(shape, tensors), shape.torch_dtype)
    with single_process_megatron():
        model = build_gpt_model(shape)
        load_model_weights(model, state)
        save_gpt_model(model, shape, output, assets_from=hf_path)
    return shape


def megatron_state_to_hf(shape: ModelShape, state, output: str, dtype: Optional[str] = None,
                         assets_from: Optional[str] = None, max_shard_bytes: int = 5 << 30) -> None:
    out_dtype = dtype or shape.params_dtype
    if out_dtype not in DTYPES:
        raise ValueError(f"--dtype {out_dtype!r} is not one of {sorted(DTYPES)}")
    tensors = cast(megatron_to_hf(shape, state), DTYPES[out_dtype])
    hf_io.write_tensors(output, tensors, max_shard_bytes)
    if assets_from is not None and os.path.isdir(assets_from):
        hf_io.copy_assets(assets_from, output)
    cfg = dict(shape.hf_config)
    cfg["dtype"] = out_dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = out_dtype
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def megatron_to_hf_checkpoint(load: str, output: str, dtype: Optional[str] = None,
                              max_shard_bytes: int = 5 << 30) -> ModelShape:
    """Export a Megatron checkpoint (converted or trained, saved under any layout) to Hugging Face."""
    shape, _ = read_shape(load)
    with single_process_megatron():
        model, shape = load_gpt_model(load)
        state = model.state_dict()
    megatron_state_to_hf(shape, state, output, dtype, os.path.join(load, ASSETS_DIR), max_shard_bytes)
    return shape


class ARScorer:
    """Next-token logits [batch, seq, vocab] of a model for sequences of one length: the AR
    objective's clean, token-causal stream through the block-diffusion wrapper (the same path the
    trainer's `--objective ar` takes)."""

    def __init__(self, model, seq_length: int):
        from megatron_csbp.layout.layout import SequenceLayout
        from megatron_csbp.layout.masks import BlockGeometry
        from megatron_csbp.model.bdlm import BlockDiffusionModel
        from megatron_csbp.objectives.ar import AutoregressiveObjective

        self.seq_length = seq_length
        self.padded = seq_length + seq_length % 2  # the layout needs an even length
        layout = SequenceLayout(BlockGeometry(self.padded, self.padded))
        self.bdlm = BlockDiffusionModel(model, AutoregressiveObjective(), layout)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] != self.seq_length:
            raise ValueError(f"tokens have length {tokens.shape[1]}, the scorer was built for {self.seq_length}")
        if self.padded != self.seq_length:  # causal rows never see the padding
            tokens = torch.cat([tokens, tokens[:, -1:]], dim=1)
        return self.bdlm.logits(tokens, self.bdlm.plan.local)[:, : self.seq_length]


def score(load: str, tokens: np.ndarray, batch_size: int = 8) -> np.ndarray:
    """float32 next-token logits [batch, seq, vocab] of the checkpoint for int token ids [batch, seq]."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"--tokens must be an integer array [batch, seq], got {tokens.dtype} {tokens.shape}")
    shape, _ = read_shape(load)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= shape.vocab_size):
        raise ValueError(f"token ids must lie in [0, {shape.vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    out = []
    with single_process_megatron():
        model, shape = load_gpt_model(load, params_dtype=torch.float32)
        model.eval()
        scorer = ARScorer(model, tokens.shape[1])
        with torch.no_grad():
            for start in range(0, tokens.shape[0], batch_size):
                chunk = torch.from_numpy(tokens[start:start + batch_size].astype(np.int64))
                out.append(scorer(chunk).float().numpy())
    return np.concatenate(out, axis=0) if out else np.zeros((0, tokens.shape[1], shape.vocab_size), np.float32)


def flags_text(shape: ModelShape) -> str:
    return " \\\n    ".join(megatron_flags(shape))
