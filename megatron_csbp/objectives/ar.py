"""Plain next-token (autoregressive) training of the same model: the AR -> BDLM starting point.

The model sees the clean stream only, token-causal; row p predicts token p+1 where both are
supervised. Denominator = number of such targets.
"""
from __future__ import annotations

from megatron_csbp.objectives.base import NoisedBatch, Objective, next_token_targets
from megatron_csbp.objectives.registry import register_objective


@register_objective("ar")
class AutoregressiveObjective(Objective):
    uses_noisy_stream = False
    target_shift = 1

    def __init__(self):
        """No settings: the model and the data say everything."""

    @classmethod
    def from_args(cls, args) -> "AutoregressiveObjective":
        return cls()

    @classmethod
    def attention_pairs(cls, seq_length: int, block_size: int, clean_attention: str) -> int:
        """Token-causal pairs of the clean stream: L (L + 1) / 2."""
        return seq_length * (seq_length + 1) // 2

    def noise(self, tokens, loss_mask, sample_index) -> NoisedBatch:
        targets = next_token_targets(tokens, loss_mask[:, 1:].bool())  # both supervised
        return NoisedBatch(tokens, targets, (targets >= 0).float())
