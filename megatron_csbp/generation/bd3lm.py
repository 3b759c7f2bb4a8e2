"""BD3-LM decoding from a checkpoint written by `python -m megatron_csbp.train`: block by block, left
to right, each step drawing the masked positions and fixing some (`steps_per_block` and `order`,
or Fast-dLLM's `threshold`), over the clean-prefix KV cache by default
(docs/training.md#generation).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from megatron_csbp.generation import kv_cache
from megatron_csbp.layout.masks import BlockGeometry, RowMeta

ORDERS = ("confidence", "random")


class BlockDiffusionSampler(kv_cache.CachedDecoder):
    def __init__(self, bdlm, vocab_size: int, mask_token_id: int, eod: int, block_size: int,
                 use_cache: bool = True):
        super().__init__(bdlm)
        self.V, self.mask_id, self.eod, self.B = vocab_size, mask_token_id, eod, block_size
        self.kv_cache = use_cache

    # -- model calls ---------------------------------------------------------------------------
    def _clean_rows(self, tokens: List[int], start: int, end: int) -> None:
        """Append clean positions [start, end) to the KV cache."""
        if end > start:
            rows = RowMeta.of(torch.zeros(0, dtype=torch.long), torch.arange(start, end))
            self._run(torch.tensor(tokens[start:end])[None], rows, "extend")

    def block_logits(self, tokens: List[int], block: int) -> torch.Tensor:
        """Logits [B, V] of the noisy rows of `block` given the clean prefix tokens[: block*B]."""
        B = self.B
        noisy_pos = torch.arange(block * B, (block + 1) * B)
        noisy_ids = torch.tensor(tokens[block * B:(block + 1) * B])
        if self.kv_cache:
            return self._run(noisy_ids[None], RowMeta.of(noisy_pos, torch.zeros(0, dtype=torch.long)), "decode")[0]
        ids = torch.cat([noisy_ids, torch.tensor(tokens[: block * B], dtype=torch.long)])
        return self._run(ids[None], RowMeta.of(noisy_pos, torch.arange(block * B)), "off")[0]

    # -- decoding ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt: List[int], max_new_tokens: int, steps_per_block: Optional[int] = None,
                 temperature: float = 0.0, seed: int = 0, max_length: Optional[int] = None,
                 order: str = "confidence", threshold: Optional[float] = None) -> List[int]:
        if order not in ORDERS:
            raise ValueError(f"--unmask-order must be one of {ORDERS}, got {order!r}")
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise ValueError(f"--threshold must be in (0, 1], got {threshold}")
        B = self.B
        total = len(prompt) + max_new_tokens if max_length is None else min(len(prompt) + max_new_tokens, max_length)
        if total <= len(prompt):
            return []
        n_blocks = math.ceil(total / B)
        length = n_blocks * B
        self.state.reset(BlockGeometry(length, B, self.bdlm.layout.geometry.clean_attention))
        tokens = list(prompt) + [self.mask_id] * (length - len(prompt))
        steps = B if threshold is not None else (steps_per_block or B)
        g = torch.Generator().manual_seed(seed)
        first = len(prompt) // B
        if self.kv_cache:
            self._clean_rows(tokens, 0, first * B)
        generated_end = length
        for block in range(first, n_blocks):
            lo = block * B
            for step in range(steps):
                masked = [p for p in range(lo, lo + B) if tokens[p] == self.mask_id and p >= len(prompt)]
                if not masked:
                    break
                logits = self.block_logits(tokens, block).float()[:, : self.V]
                logits[:, self.mask_id] = float("-inf")
                idx = torch.tensor([p - lo for p in masked])
                probs = torch.softmax(logits[idx] / temperature if temperature > 0 else logits[idx], -1)
                pred = torch.multinomial(probs, 1, generator=g)[:, 0] if temperature > 0 else probs.argmax(-1)
                confidence = probs.gather(1, pred[:, None])[:, 0]
                count = math.ceil(len(masked) / (steps - step))
                if threshold is not None:  # Fast-dLLM: all confident positions, at least the best one
                    chosen = torch.nonzero(confidence >= threshold)[:, 0].tolist() or [int(confidence.argmax())]
                elif order == "random":  # MDLM's ancestral order: any masked position is equally likely
                    chosen = torch.randperm(len(masked), generator=g)[:count].tolist()
                else:
                    chosen = torch.topk(confidence, count).indices.tolist()
                for j in chosen:
                    tokens[masked[j]] = int(pred[j])
            if self.eod in tokens[max(lo, len(prompt)):lo + B]:  # the block's new tokens
                generated_end = tokens.index(self.eod, max(lo, len(prompt)))
                break
            if self.kv_cache:
                self._clean_rows(tokens, lo, lo + B)
        self.state.mode = "off"
        return tokens[len(prompt):min(generated_end, total)]
