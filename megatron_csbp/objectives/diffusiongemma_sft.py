"""DiffusionGemma native SFT objective (`--objective diffusiongemma-sft`): uniform-state noise on
response blocks (canvases), a diffusion loss plus the clean stream's AR loss, self-conditioning.
Definitions and the choices the sources leave open: docs/diffusiongemma.md#diffusiongemma-sft.
"""
from __future__ import annotations

import torch

from megatron_csbp.objectives.base import (NoisedBatch, Objective, block_times, next_token_targets,
                                           sample_generator)
from megatron_csbp.objectives.flags import IN_0_1, NOISE_FLAGS, NOISE_OPTIONS, option
from megatron_csbp.objectives.registry import register_objective
from megatron_csbp.utils.option import must

ENCODER_LOSS_WEIGHT = option("--encoder-loss-weight", float, 1.0, "diffusiongemma-sft: weight of the AR next-token "
                             "loss on the clean stream", rule=must(lambda v: v >= 0, "must be >= 0"))
BLOCK_TIMES = option("--block-times", None, None, "diffusiongemma-sft: a sample's response-block times, antithetic (the "
                     "reference's, the default) or independent (the rule before; a resume keeps its checkpoint's)",
                     choices=("antithetic", "independent"), fallback="antithetic", before="independent", saved=True)
ENCODER_LOSS_SCOPE = option("--encoder-loss-scope", None, None, "diffusiongemma-sft: the clean stream's AR loss over "
                            "every valid next-token pair, prompts included, over the global batch's pair count (all: "
                            "the reference's, the default), or over response targets, a token mean per sample "
                            "(response: the rule before; a resume keeps its checkpoint's)",
                            choices=("all", "response"), fallback="all", before="response", saved=True)
SELF_CONDITIONING_PROB = option("--self-conditioning-prob", float, 0.5, "diffusiongemma-sft: probability that a sample "
                                "gets the self-conditioning pass", rule=IN_0_1)


@register_objective("diffusiongemma-sft")
class DiffusionGemmaSFTObjective(Objective):
    fixed_rows = False  # canvases of response blocks
    summary = ("DiffusionGemma's native SFT (uniform noise, canvas of response blocks, AR loss on the clean "
               "stream, self-conditioning) for a converted DiffusionGemma / Gemma 4 --load checkpoint and "
               "--sft-data-path")
    flags = (ENCODER_LOSS_WEIGHT, SELF_CONDITIONING_PROB, BLOCK_TIMES, ENCODER_LOSS_SCOPE) + NOISE_FLAGS
    reads_documents = True  # pairs of the AR term stay inside a packed document
    #: the model must also return logits for the clean rows (AR loss)
    needs_clean_logits = True
    megatron_lm_refusal = ("runs in python -m megatron_csbp.train (DiffusionGemma is built from a converted "
                           "checkpoint, not from Megatron-LM flags)")

    #: constructor keyword (and attribute) -> its flag
    options = dict(NOISE_OPTIONS, block_times=BLOCK_TIMES, encoder_loss_scope=ENCODER_LOSS_SCOPE,
                   self_conditioning_prob=SELF_CONDITIONING_PROB, encoder_loss_weight=ENCODER_LOSS_WEIGHT)

    def __init__(self, block_size: int, vocab_size: int, seed: int = 1234, pad_id=None, **options):
        """`options`: the keywords of `options` (their flags' defaults when not given)."""
        vars(self).update(self.option_values(**options))
        self.block_size, self.vocab_size, self.seed = int(block_size), int(vocab_size), seed
        self.antithetic = self.block_times == "antithetic"
        #: the SFT data's padding id (unsupervised tokens equal to it are no AR pair); None: no padding
        self.pad_id = pad_id

    @classmethod
    def validate(cls, args, facts=None) -> None:
        """DiffusionGemma's SFT trains a DiffusionGemma (a converted checkpoint's shape; skipped
        by `launch --check` without the checkpoint) on SFT data."""
        family = getattr(getattr(facts, "model_shape", None), "family", None)
        if family != "diffusion_gemma" and not getattr(facts, "shape_unknown", False):
            raise ValueError("--objective diffusiongemma-sft trains a DiffusionGemma: --load a checkpoint converted "
                             "from a diffusion_gemma or Gemma 4 MoE model (python -m megatron_csbp.convert hf-to-megatron)")
        if not args.sft_data_path:
            raise ValueError("--objective diffusiongemma-sft needs --sft-data-path (prompt/response data with loss masks)")
        cls.option_values(args)

    @classmethod
    def from_args(cls, args) -> "DiffusionGemmaSFTObjective":
        return cls(args.block_size, args.vocab_size, seed=args.seed, pad_id=getattr(args, "pad_token_id", None),
                   **cls.option_values(args))

    @classmethod
    def build_datasets(cls, args):
        """SFT pairs, prompts padded so that every response starts on a block boundary."""
        from megatron_csbp.objectives.data import sft_datasets
        return sft_datasets(args, align_response_to=args.block_size)

    def check_vocab(self, vocab_size: int) -> None:
        if vocab_size != self.vocab_size:
            raise ValueError(f"objective draws noise from {self.vocab_size} ids, the model has {vocab_size}")

    def response_blocks(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """[b, n] bool: blocks holding supervised tokens. Refuses responses that start mid-block."""
        (b, L), B = loss_mask.shape, self.block_size
        self.num_blocks(L)  # whole blocks only
        sup = loss_mask.bool()
        has = sup.any(dim=1)
        first = torch.where(has, sup.float().argmax(dim=1), torch.zeros_like(has, dtype=torch.long))
        bad = has & (first % B != 0)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"sample {i}: the response starts at position {int(first[i])}, not on a multiple of "
                             f"--block-size {B}; pad prompts to whole blocks for diffusiongemma-sft")
        return sup.view(b, L // B, B).any(dim=2)

    def valid_pairs(self, tokens, loss_mask, document_ids=None) -> torch.Tensor:
        """[b, L - 1] bool: next-token pairs (p, p + 1) of the AR term. `all`: both tokens are no
        padding (an unsupervised `pad_id`) and in the same document; `response`: p + 1 is supervised."""
        sup = loss_mask.bool()
        if self.encoder_loss_scope == "response":
            return sup[:, 1:]
        valid = torch.ones_like(sup) if tokens is None or self.pad_id is None else (tokens != self.pad_id) | sup
        ok = valid[:, 1:] & valid[:, :-1]
        if document_ids is not None:
            ok = ok & (document_ids[:, 1:] == document_ids[:, :-1])
        return ok

    def noise(self, tokens, loss_mask, sample_index, document_ids=None) -> NoisedBatch:
        (b, L), B = tokens.shape, self.block_size
        n = L // B
        blocks = self.response_blocks(loss_mask)  # [b, n]
        sup = loss_mask.bool()
        t_rows, draw_rows, rand_rows, sc = [], [], [], []
        for i in range(b):
            g = sample_generator(self.seed, int(sample_index[i]))
            if self.antithetic:  # stratified over the sample's own response blocks
                t = torch.full((n,), self.eps_max, dtype=torch.float64)
                t[blocks[i].cpu()] = block_times(int(blocks[i].sum()), g, self.eps_min, self.eps_max)
            else:
                t = block_times(n, g, self.eps_min, self.eps_max, antithetic=False)
            t_rows.append(t.float().repeat_interleave(B))
            draw_rows.append(torch.rand(L, generator=g))
            rand_rows.append(torch.randint(0, self.vocab_size, (L,), generator=g))
            sc.append(bool(torch.rand(1, generator=g).item() < self.self_conditioning_prob))
        dev = tokens.device
        t = torch.stack(t_rows).to(dev)
        replace = (torch.stack(draw_rows).to(dev) < t) & sup
        noisy = torch.where(replace, torch.stack(rand_rows).to(dev), tokens)

        # Diffusion targets: every supervised token of a response block; weight 1 / (blocks * tokens).
        tokens_per_block = sup.view(b, n, B).sum(dim=2).clamp_min(1).float()  # [b, n]
        blocks_per_sample = blocks.sum(dim=1).clamp_min(1).float()  # [b]
        w_block = (1.0 / (tokens_per_block * blocks_per_sample[:, None])).repeat_interleave(B, dim=1)
        targets = torch.where(sup, tokens, torch.full_like(tokens, -100))
        weights = torch.where(sup, w_block, torch.zeros_like(w_block))

        # AR targets on the clean stream: row p -> token p+1 over the valid pairs. `all`: weight
        # encoder_loss_weight, over the global pair count (the denominator's second entry);
        # `response`: the per-sample token mean, over the sample count.
        clean_targets = next_token_targets(tokens, self.valid_pairs(tokens, loss_mask, document_ids))
        per_pair = torch.full((b,), self.encoder_loss_weight, device=dev)
        if self.encoder_loss_scope == "response":
            per_pair = per_pair / (clean_targets >= 0).sum(dim=1).clamp_min(1).float()
        clean_weights = torch.where(clean_targets >= 0, per_pair[:, None], torch.zeros(b, L, device=dev))

        has = blocks.any(dim=1)
        first_block = int(blocks.float().argmax(dim=1)[has].min()) if bool(has.any()) else n
        return NoisedBatch(noisy, targets, weights, None, clean_targets, clean_weights,
                           torch.tensor(sc, device=dev), first_block)

    def denominator(self, loss_mask, tokens=None, document_ids=None):
        """Samples with a response (the diffusion loss is a mean over samples); `all`: and the valid
        next-token pairs (the AR loss is a mean over them)."""
        samples = loss_mask.bool().any(dim=1).sum().to(torch.float32)
        if self.encoder_loss_scope == "response":
            return samples
        pairs = self.valid_pairs(tokens, loss_mask, document_ids).sum().to(torch.float32)
        return torch.stack([samples, pairs])
