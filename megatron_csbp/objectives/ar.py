"""Plain next-token (autoregressive) training of the same model: the AR -> BDLM starting point.

The model sees the clean stream only, token-causal; row p predicts token p+1 where both are
supervised. Denominator = number of such targets.
"""
from __future__ import annotations

import torch

from megatron_csbp.objectives.base import NoisedBatch, Objective


class AutoregressiveObjective(Objective):
    name = "ar"
    uses_noisy_stream = False

    def noise(self, tokens, loss_mask, sample_index) -> NoisedBatch:
        targets = torch.full_like(tokens, -100)
        ok = loss_mask[:, 1:].bool()
        targets[:, :-1] = torch.where(ok, tokens[:, 1:], targets[:, :-1])
        weights = (targets >= 0).float()
        return NoisedBatch(tokens, targets, weights)

    def denominator(self, loss_mask):
        return loss_mask[:, 1:].sum().to(torch.float32)
