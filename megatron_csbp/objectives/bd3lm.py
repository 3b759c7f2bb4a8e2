"""The standard block-diffusion objective (BD3-LM / MDLM with absorbing noise): antithetic block
times per sample, the mask token excluded from the softmax, loss sum w(t) CE over the global
supervised-token count. Definitions: docs/semantics.md#bd3-lm-objective-objectivesbd3lmpy.
"""
from __future__ import annotations

import torch

from megatron_csbp.objectives.base import NoisedBatch, Objective, block_times, sample_generator
from megatron_csbp.objectives.flags import MASK_TOKEN_FLAGS, NOISE_FLAGS, NOISE_OPTIONS, option
from megatron_csbp.objectives.registry import register_objective

LOSS_WEIGHTINGS = ("inverse_t", "unit")
LOSS_WEIGHTING = option("--loss-weighting", None, "inverse_t", "weight of a masked token's CE: 1/t (the NELBO) or 1",
                        choices=LOSS_WEIGHTINGS, saved=True)


@register_objective("bd3lm")
class BD3LMObjective(Objective):
    exclude_mask_from_softmax = True
    flags = MASK_TOKEN_FLAGS + NOISE_FLAGS + (LOSS_WEIGHTING,)
    options = dict(NOISE_OPTIONS, loss_weighting=LOSS_WEIGHTING)
    mask_token_needed = "--mask-token-id (a token id the data never uses; the tokenizer has no <mask>)"
    mask_from_tokenizer = True

    def for_evaluation(self) -> "BD3LMObjective":
        """Always the NELBO (t ~ U[1e-3, 1], 1/t weights), an upper bound on the model's NLL in
        nats/token, whatever schedule training draws from (`--noise-eps-min/max`,
        `--loss-weighting`): so held-out losses of runs with different training schedules compare."""
        return BD3LMObjective(self.block_size, self.mask_token_id, seed=self.seed)

    def block_times(self, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
        return block_times(num_blocks, generator, self.eps_min, self.eps_max).float()

    def times_and_draws(self, tokens, sample_index):
        """Per token: its block's time t and one uniform draw, both [b, L], from (seed, sample)."""
        b, L = tokens.shape
        n = self.num_blocks(L)  # whole blocks only
        t_rows, draw_rows = [], []
        for i in range(b):
            g = sample_generator(self.seed, int(sample_index[i]))
            t_rows.append(self.block_times(n, g).repeat_interleave(self.block_size))
            draw_rows.append(torch.rand(L, generator=g))
        return torch.stack(t_rows).to(tokens.device), torch.stack(draw_rows).to(tokens.device)

    def noise(self, tokens, loss_mask, sample_index) -> NoisedBatch:
        t, draws = self.times_and_draws(tokens, sample_index)
        # A data token equal to the mask id is never noised and never a target: the mask column is
        # excluded from the softmax, so its probability is 0 (an infinite loss). Its draw is still
        # consumed, so every other token's noise is unchanged. It is no supervised token either
        # (`BlockDiffusionModel.supervised` drops it from the loss mask the denominator counts).
        supervised = loss_mask.bool() & (tokens != self.mask_token_id)
        masked = (draws < t) & supervised
        noisy = torch.where(masked, torch.full_like(tokens, self.mask_token_id), tokens)
        targets = torch.where(masked, tokens, torch.full_like(tokens, -100))
        w = (1.0 / t) if self.loss_weighting == "inverse_t" else torch.ones_like(t)
        weights = torch.where(masked, w, torch.zeros_like(w))
        return NoisedBatch(noisy, targets, weights)
