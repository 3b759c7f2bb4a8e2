"""Block-diffusion decoding from a checkpoint written by `python -m megatron_csbp.train`:

    python -m megatron_csbp.generate --load runs/default/checkpoints --prompt "The for statement"

Decoding goes block by block, left to right. The prompt fills the first positions; every later
position starts as the mask token. For the current block the model sees the block's noisy rows
(known tokens and masks) and the clean prefix before it; at each of `--steps-per-block` steps the
masked positions with the most confident predictions (largest softmax probability, mask token
excluded) are fixed (`--unmask-order random`: positions drawn uniformly instead, MDLM's ancestral
order, which keeps small models from filling blocks with their most frequent piece), until the
block has no mask left. The finished block becomes clean context.
Decoding stops after the block in which EOD appears (the text is cut at EOD) or at
`--max-new-tokens`.

Clean-prefix KV reuse: clean rows attend only to clean rows at or before their block, so their keys
and values never change once a block is final. Each layer's core attention is wrapped: a finished
block is run once as clean rows, its K/V appended to a per-layer cache; denoising steps run only
the B noisy rows and attend to [cached clean K/V ; the block's own K/V] under the same mask
predicate as training. `--no-kv-cache` recomputes the clean prefix every step through the
training code path (same logits up to float rounding; a test checks it).

The checkpoint is loaded into TP = CP = BP = 1 on one process, whatever layout wrote it.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from megatron_csbp.layout.masks import BlockGeometry, RowMeta
from megatron_csbp.layout.rows import PartialMask
from megatron_csbp.utils.cli import ArgumentParser, run


@dataclass
class _CacheState:
    mode: str = "off"  # 'off' (training path) | 'extend' (clean rows -> cache) | 'decode' (noisy rows)
    rows: Optional[RowMeta] = None
    geometry: Optional[BlockGeometry] = None
    kv: Dict[int, tuple] = field(default_factory=dict)  # layer -> (k, v, RowMeta of cached clean rows)


class CachedBlockAttention(torch.nn.Module):
    """Wraps a BlockDiffusionAttention: passes through in 'off' mode, uses the clean K/V cache otherwise."""

    def __init__(self, inner, state: _CacheState):
        super().__init__()
        self.inner, self.state = inner, state

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        st = self.state
        if st.mode == "off":
            return self.inner(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        from megatron_csbp.attention.kernels import get_kernel

        layer = self.inner.layer_number
        geometry = st.geometry.with_window(self.inner.window)
        cached = st.kv.get(layer)
        if cached is not None:
            k_all = torch.cat([cached[0], key], 0)
            v_all = torch.cat([cached[1], value], 0)
            k_meta = RowMeta.cat([cached[2], st.rows])
        else:
            k_all, v_all, k_meta = key, value, st.rows
        # Row vectors of this call's queries and cached + new keys; the layer's kernel (tiled on
        # CPU) never builds a [queries x keys] mask.
        mask = PartialMask.of(st.rows, k_meta, geometry).to(query.device)
        kernel = get_kernel(self.inner.kernel_name, query.device)
        out, _ = kernel(query, k_all, v_all, mask, self.inner.softmax_scale)
        if st.mode == "extend":
            st.kv[layer] = (k_all.detach(), v_all.detach(), k_meta)
        sq, b, H, d = out.shape
        return out.reshape(sq, b, H * d)


def _install_cache(gpt, state: _CacheState) -> int:
    from megatron_csbp.attention.core_attention import BlockDiffusionAttention

    n = 0
    for module in gpt.modules():
        ca = getattr(module, "core_attention", None)
        if isinstance(ca, BlockDiffusionAttention):
            module.core_attention = CachedBlockAttention(ca, state)
            n += 1
    return n


class BlockDiffusionSampler:
    def __init__(self, bdlm, vocab_size: int, mask_token_id: int, eod: int, block_size: int,
                 kv_cache: bool = True):
        self.bdlm, self.gpt = bdlm, bdlm.gpt
        self.V, self.mask_id, self.eod, self.B = vocab_size, mask_token_id, eod, block_size
        self.kv_cache = kv_cache
        self.state = _CacheState()
        _install_cache(self.gpt, self.state)
        self.forward_calls = 0

    # -- model calls ---------------------------------------------------------------------------
    def _run(self, ids: torch.Tensor, rows: RowMeta) -> torch.Tensor:
        """Logits of `rows` (their noisy rows; every row when all are clean) fed with `ids`."""
        from megatron_csbp.attention.block_attention import AttentionPlan

        self.forward_calls += 1
        return self.bdlm.logits(ids[None], AttentionPlan(self.state.geometry, rows))[0]

    def _clean_rows(self, tokens: List[int], start: int, end: int) -> None:
        """Append clean positions [start, end) to the KV cache."""
        if end <= start:
            return
        self.state.mode = "extend"
        self.state.rows = RowMeta.of(torch.zeros(0, dtype=torch.long), torch.arange(start, end))
        self._run(torch.tensor(tokens[start:end]), self.state.rows)

    def block_logits(self, tokens: List[int], block: int) -> torch.Tensor:
        """Logits [B, V] of the noisy rows of `block` given the clean prefix tokens[: block*B]."""
        B = self.B
        noisy_pos = torch.arange(block * B, (block + 1) * B)
        noisy_ids = torch.tensor(tokens[block * B:(block + 1) * B])
        if self.kv_cache:
            self.state.mode = "decode"
            self.state.rows = RowMeta.of(noisy_pos, torch.zeros(0, dtype=torch.long))
            return self._run(noisy_ids, self.state.rows)
        self.state.mode = "off"
        clean_pos = torch.arange(block * B)
        rows = RowMeta.of(noisy_pos, clean_pos)
        ids = torch.cat([noisy_ids, torch.tensor(tokens[: block * B], dtype=torch.long)])
        return self._run(ids, rows)

    # -- decoding ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt: List[int], max_new_tokens: int, steps_per_block: Optional[int] = None,
                 temperature: float = 0.0, seed: int = 0, max_length: Optional[int] = None,
                 order: str = "confidence") -> List[int]:
        B = self.B
        total = len(prompt) + max_new_tokens
        if max_length is not None:
            total = min(total, max_length)
        if total <= len(prompt):
            return []
        n_blocks = math.ceil(total / B)
        length = n_blocks * B
        self.state.geometry = BlockGeometry(length, B, self.bdlm.layout.geometry.clean_attention)
        self.state.kv.clear()
        tokens = list(prompt) + [self.mask_id] * (length - len(prompt))
        steps = steps_per_block or B
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
                probs = torch.softmax(logits[idx] / max(temperature, 1e-6), -1) if temperature > 0 else \
                    torch.softmax(logits[idx], -1)
                if temperature > 0:
                    pred = torch.multinomial(probs, 1, generator=g)[:, 0]
                else:
                    pred = probs.argmax(-1)
                k = math.ceil(len(masked) / (steps - step))
                if order == "random":  # MDLM's ancestral order: any masked position is equally likely
                    chosen = torch.randperm(len(masked), generator=g)[:k].tolist()
                else:
                    chosen = torch.topk(probs.gather(1, pred[:, None])[:, 0], k).indices.tolist()
                for j in chosen:
                    tokens[masked[j]] = int(pred[j])
            block_tokens = tokens[lo:lo + B]
            new = [t for p, t in zip(range(lo, lo + B), block_tokens) if p >= len(prompt)]
            if self.eod in new:
                generated_end = lo + block_tokens.index(self.eod, max(0, len(prompt) - lo))
                break
            if self.kv_cache:
                self._clean_rows(tokens, lo, lo + B)
        self.state.mode = "off"
        return tokens[len(prompt):min(generated_end, total)]


def load_for_generation(load: str, ckpt_step: Optional[int] = None, kv_cache: bool = True):
    """Build a TP = CP = BP = 1 model from the checkpoint's saved hyper-parameters and load it."""
    from megatron_csbp.training.trainer import load_model

    def decodable(margs) -> None:
        if margs.get("objective") != "bd3lm":
            # Fast-dLLM v2 decodes with a token shift, DiffusionGemma from uniform noise with
            # self-conditioning: neither is this sampler. Checked before building the model.
            raise ValueError(f"--load {load}: checkpoint objective is {margs.get('objective')!r}; this sampler "
                             "decodes BD3-LM (--objective bd3lm) checkpoints. Export others with `python -m "
                             "megatron_csbp.convert megatron-to-hf` and generate with their Hugging Face model")

    return load_model(load, ckpt_step, decodable)


def main(argv: Optional[Sequence[str]] = None) -> str:
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    p = ArgumentParser(prog="python -m megatron_csbp.generate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True)
    p.add_argument("--ckpt-step", type=int, default=None)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps-per-block", type=int, default=None, help="default: the block size")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-model", default=None, help="default: the one saved with the checkpoint")
    p.add_argument("--no-kv-cache", action="store_true")
    p.add_argument("--unmask-order", choices=("confidence", "random"), default="confidence",
                   help="which masked positions a step fixes: the most confident, or uniformly drawn ones")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        model, margs, step = load_for_generation(a.load, a.ckpt_step, not a.no_kv_cache)
    except ValueError as exc:
        p.error(str(exc))
    from megatron_csbp.data.megatron_data import build_tokenizer

    tok = build_tokenizer(margs.get("tokenizer_type") or "SentencePieceTokenizer",
                          a.tokenizer_model or margs.get("tokenizer_model"), margs.get("vocab_size"))
    sampler = BlockDiffusionSampler(model.bdlm, margs["vocab_size"], margs["mask_token_id"], tok.eod,
                                    margs["block_size"], kv_cache=not a.no_kv_cache)
    prompt = tok.tokenize(a.prompt)
    if len(prompt) >= margs["seq_length"]:
        p.error(f"--prompt has {len(prompt)} tokens; the model was trained on --seq-length {margs['seq_length']}")
    out = sampler.generate(prompt, a.max_new_tokens, a.steps_per_block, a.temperature, a.seed,
                           max_length=margs["seq_length"], order=a.unmask_order)
    text = tok.detokenize(out)
    print(f"[checkpoint {a.load} iteration {step}; {sampler.forward_calls} forward calls]")
    print(tok.detokenize(prompt + out))  # decoded together: the word boundary at the prompt's end stays
    return text


if __name__ == "__main__":
    sys.exit(run(main))
