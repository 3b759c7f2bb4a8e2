"""What an objective gives the model: the noisy stream, per-row targets and weights, a denominator.

Noise depends only on (seed, the sample's global index): every rank of a model replica draws the
same noise for the same sample, so the loss does not depend on the parallel layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class NoisedBatch:
    noisy_tokens: torch.Tensor  # [b, L] ids fed to the noisy rows
    targets: torch.Tensor  # [b, L] target id of each noisy row, -100 where the row is no target
    weights: torch.Tensor  # [b, L] float32 loss weight of each noisy row (0 where no target)
    # Objectives that expand the batch (e.g. complementary views) give the clean stream of each
    # returned row; None means the input tokens.
    clean_tokens: Optional[torch.Tensor] = None
    # Objectives with a loss on the clean stream (DiffusionGemma's AR term): target of clean row p
    # (-100 where none) and its weight, [b, L]; `BlockDiffusionModel` then sends the clean rows
    # that carry a target (on the rank that counts them) through the output layer too.
    clean_targets: Optional[torch.Tensor] = None
    clean_weights: Optional[torch.Tensor] = None
    #: [b] bool: the sample gets a self-conditioning first pass (None: the objective has none)
    self_conditioning: Optional[torch.Tensor] = None
    #: first block with a noisy copy (canvas of response blocks); None: every block
    first_canvas_block: Optional[int] = None


def sample_generator(seed: int, sample_index: int) -> torch.Generator:
    """A CPU generator keyed by (seed, global sample index), independent of rank and layout."""
    state = np.random.SeedSequence([int(seed), int(sample_index)]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


class Objective:
    """Base class. Subclasses set `name` and implement `noise`."""

    name = "base"
    #: False for plain next-token training: the model sees the clean stream only
    uses_noisy_stream = True
    #: exclude the mask token's logit from the softmax (absorbing-state MDLM losses)
    exclude_mask_from_softmax = False
    mask_token_id = None
    #: the loss has terms on clean rows (`NoisedBatch.clean_targets`); layouts then assign every
    #: clean row's term to one rank (`SequenceLayout.clean_loss`)
    needs_clean_logits = False

    def noise(self, tokens: torch.Tensor, loss_mask: torch.Tensor, sample_index: torch.Tensor) -> NoisedBatch:
        raise NotImplementedError

    def denominator(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the loss denominator (summed over the global batch)."""
        return loss_mask.sum().to(torch.float32)

    def check_vocab(self, vocab_size: int) -> None:
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab_size:
            raise ValueError(
                f"--mask-token-id {self.mask_token_id} is outside the vocabulary [0, {vocab_size})"
            )
