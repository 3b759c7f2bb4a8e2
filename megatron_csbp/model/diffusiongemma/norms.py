"""Gemma RMSNorm: `x * (mean(x^2) + eps)^-0.5 * w` computed in at least fp32 (fp64 for fp64 inputs) with a plain weight `w`
(not Gemma 3's `1 + w`), cast back to the input dtype; optionally without a weight (`v_norm`, the
router's input norm, the canvas post-norm). Signature of a Megatron norm module."""
from __future__ import annotations

import torch

from megatron.core.transformer.module import MegatronModule

from megatron_csbp.utils.precision import at_least_fp32


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without weight in at least fp32 (returns that dtype)."""
    xf = at_least_fp32(x)
    return xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class GemmaRMSNorm(MegatronModule):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__(config=config)
        self.eps, self.with_scale = eps, with_scale
        if with_scale:
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
            # Replicated over TP: with sequence parallelism its gradient is a TP partial sum.
            setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = rms_normalize(x, self.eps)
        if self.with_scale:
            out = out * at_least_fp32(self.weight)
        return out.type_as(x)


class WeightlessRMSNorm(GemmaRMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__(config, hidden_size, eps, with_scale=False)
