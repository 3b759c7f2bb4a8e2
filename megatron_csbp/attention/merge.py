"""The exact merge of partial attentions over disjoint key sets by their log-sum-exp.

Every kernel (`attention/kernels.py`) returns (out, lse) for one key set; local noisy keys,
gathered clean keys, ring chunks and a flash decomposition's pieces meet here. This module imports
no kernel, so every kernel module can merge without importing the kernel registry.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from megatron_csbp.utils.precision import compute_dtype


class PartialMerge:
    """Running log-sum-exp merge of partial attentions over disjoint key sets: one fp32
    accumulator (fp64 for fp64 inputs), whatever the number of partials (a ring merges each chunk
    as it arrives instead of stacking all of them)."""

    def __init__(self):
        self.out: Optional[torch.Tensor] = None
        self.lse: Optional[torch.Tensor] = None
        self.dtype: Optional[torch.dtype] = None
        self.count = 0

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.count += 1
        if self.count == 1:
            self.out, self.lse, self.dtype = out, lse, out.dtype
            return
        cdt = compute_dtype(self.dtype)
        new = torch.logaddexp(self.lse, lse)
        # lse [b, H, sq] -> weights [sq, b, H, 1] on the outputs.
        w_old = torch.exp(self.lse - new).permute(2, 0, 1).unsqueeze(-1)
        w_new = torch.exp(lse - new).permute(2, 0, 1).unsqueeze(-1)
        self.out = self.out.to(cdt) * w_old + out.to(cdt) * w_new
        self.lse = new

    def result(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.count == 0:
            raise ValueError("no partial to merge")
        return self.out.to(self.dtype), self.lse


def merged(partials: Iterable[Optional[Tuple[torch.Tensor, torch.Tensor]]]) -> PartialMerge:
    """The running merge of `partials` (None: a chunk nobody attends), one accumulator in flight:
    ring chunks merge as they arrive."""
    merge = PartialMerge()
    for part in partials:
        if part is not None:
            merge.add(*part)
    return merge


def merge_partials(partials: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact combination of partial attentions over disjoint key sets, in fp32, streamed."""
    return merged(partials).result()
