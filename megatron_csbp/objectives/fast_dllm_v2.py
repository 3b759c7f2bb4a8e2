"""Fast-dLLM v2: turning an autoregressive model into a block diffusion LM (arXiv 2509.26328).

Complementary mask pairs (m, 1 - m) per sample, token shift keeping the AR head, unit weights, the
AR loss's denominator; the mask token is an existing id. Definitions:
docs/conversion.md#ar---bdlm-the-fast-dllm-v2-objective.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_csbp.objectives.base import NoisedBatch, Objective, next_token_targets
from megatron_csbp.objectives.bd3lm import BD3LMObjective
from megatron_csbp.objectives.flags import MASK_TOKEN_FLAGS, NOISE_FLAGS, NOISE_OPTIONS, check_mask_token_id
from megatron_csbp.objectives.registry import register_objective


@register_objective("fast-dllm-v2")
class FastDLLMv2Objective(Objective):
    summary = "AR -> BDLM adaptation (complementary masks, token shift), for a converted --load checkpoint"
    exclude_mask_from_softmax = False
    flags = MASK_TOKEN_FLAGS + NOISE_FLAGS
    options = NOISE_OPTIONS
    views = 2  # the complementary pair m, 1 - m
    target_shift = 1  # token shift: row i predicts token i + 1
    mask_token_needed = "--mask-token-id or --mask-token (an existing reserved mask token the data never uses)"
    needs_pretrained = "adapts a pretrained autoregressive model"

    # the same antithetic per-block times and per-token draws as BD3-LM
    block_times = BD3LMObjective.block_times
    times_and_draws = BD3LMObjective.times_and_draws

    def noise(self, tokens, loss_mask, sample_index) -> NoisedBatch:
        supervised = loss_mask.bool()
        t, draws = self.times_and_draws(tokens, sample_index)
        m = (draws < t) & supervised  # the first view's mask: supervised tokens drawn with their block's t
        # Rows 2i and 2i+1 are the two complementary views of sample i.
        masked = torch.stack([m, supervised & ~m], dim=1).flatten(0, 1)  # [2b, L]
        clean = tokens.repeat_interleave(2, dim=0)
        noisy = torch.where(masked, torch.full_like(clean, self.mask_token_id), clean)
        targets = next_token_targets(clean, masked[:, 1:])
        return NoisedBatch(noisy, targets, (targets >= 0).float(), clean_tokens=clean)


def resolve_mask_token(value: Union[int, str], tokenizer_path: Optional[str] = None,
                       vocab_size: Optional[int] = None) -> int:
    """The id of the mask token given as an id ("151665") or as a token string ("<|mask|>").

    A string must already be one token of the tokenizer (`tokenizer.json` in `tokenizer_path`:
    its vocabulary or its added tokens): Fast-dLLM v2 reuses a reserved token, never resizing the
    embedding. The id must lie inside the model's vocabulary (`vocab_size`, which may be larger
    than the tokenizer's: the spare rows are usable reserved ids)."""
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        token_id = int(value)
    else:
        token_id = _lookup_token(str(value), tokenizer_path)
    try:
        check_mask_token_id(token_id, vocab_size, vocabulary="model's vocabulary")
    except ValueError as exc:
        raise ValueError(f"{exc}; Fast-dLLM v2 reuses an existing (reserved) token and does not resize the "
                         "embedding") from None
    return token_id


def _lookup_token(token: str, tokenizer_path: Optional[str]) -> int:
    if tokenizer_path is None:
        raise ValueError(f"mask token {token!r} given as a string: the tokenizer folder is needed to find its id "
                         "(or pass the id)")
    path = os.path.join(tokenizer_path, "tokenizer.json") if os.path.isdir(tokenizer_path) else tokenizer_path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer.json at {tokenizer_path} to look up mask token {token!r}")
    data = json.loads(Path(path).read_text())
    vocab = (data.get("model") or {}).get("vocab")
    # token -> id: the model's vocabulary (a dict, or unigram's [[piece, score], ...]), the added tokens first
    ids = {entry[0]: i for i, entry in enumerate(vocab) if entry} if isinstance(vocab, list) else {}
    ids.update(vocab if isinstance(vocab, dict) else {})
    ids.update((added.get("content"), added["id"]) for added in data.get("added_tokens", []))
    if token in ids:
        return int(ids[token])
    raise ValueError(f"mask token {token!r} is not a token of {path}; Fast-dLLM v2 reuses an existing reserved "
                     "token (no embedding resize): pick one of the tokenizer's added/reserved tokens or pass an id")
