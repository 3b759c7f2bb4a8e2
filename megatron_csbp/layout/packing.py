"""Megatron's packed-document flags, applied to one micro-batch: `Packing`.

`--reset-attention-mask`: attention stays inside each document (`layout.masks.Documents`, read
from the clean tokens: an EOD token ends the document it belongs to); `--reset-position-ids`:
positions restart at each document; `--eod-mask-loss`: a row that reads an EOD has no target (Megatron's
`loss_mask[data == eod] = 0`: for block diffusion the EOD itself, for the shifted AR and
Fast-dLLM v2 objectives the next document's first token); the mask also sets the denominator
(supervised targets of the global batch), so normalisation is Megatron's: over the batch's targets,
not per document. What a packed sample changes is its plan
(`AttentionPlan.for_documents`) and its loss mask; rows, layout and noise are untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron_csbp.layout.masks import Documents

PACKING_FLAGS = ("reset_attention_mask", "reset_position_ids", "eod_mask_loss")


def block_costs(documents: Documents, block_size: int, seq_length: int) -> Tuple[int, ...]:
    """Attention cost of each block's noisy queries under `documents`: per piece of n rows whose
    block starts c rows after its document's start, n x (n + c) allowed pairs (its own piece and
    its document's clean prefix). One int per block (16K at 256K tokens, B = 16)."""
    B = block_size
    pos = torch.arange(seq_length)
    start = documents.start_of(pos)
    piece = torch.maximum((pos // B) * B, start)  # the piece id of each position (masks.noisy_block_id)
    n = torch.bincount(piece, minlength=seq_length)[piece]  # rows of each position's piece
    prefix = piece - start  # clean rows of its document before the piece
    per_row = n + prefix  # keys one noisy query of the piece sees
    return tuple(torch.zeros(seq_length // B, dtype=torch.long).index_add_(0, pos // B, per_row).tolist())


@dataclass(frozen=True)
class Packing:
    eod_token_id: Optional[int] = None
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False

    def __post_init__(self):
        if (self.reset_attention_mask or self.reset_position_ids or self.eod_mask_loss) and self.eod_token_id is None:
            raise ValueError("--reset-attention-mask, --reset-position-ids and --eod-mask-loss need the EOD token id "
                             "(the tokenizer's EOD, or --eod-token-id)")

    @staticmethod
    def of(args) -> Optional["Packing"]:
        """From a namespace or ModelArgs with Megatron's flag names; None when no flag is set."""
        flags = {f: bool(getattr(args, f, False)) for f in PACKING_FLAGS}
        if not any(flags.values()):
            return None
        return Packing(getattr(args, "eod_token_id", None), **flags)

    @property
    def splits_documents(self) -> bool:
        """Whether a sample's plan depends on its documents."""
        return self.reset_attention_mask or self.reset_position_ids

    def documents(self, tokens: torch.Tensor, document_ids: Optional[torch.Tensor] = None) -> Documents:
        """The documents of one sample: given as ids [L] (packed SFT), else from its clean tokens [L]."""
        if document_ids is not None:
            return Documents.of_ids(document_ids.detach().cpu())
        return Documents.of_eod(tokens.detach().cpu(), self.eod_token_id)

    def plan(self, plan, tokens: torch.Tensor, document_ids: Optional[torch.Tensor] = None):
        """`plan` for one sample of clean tokens [L] (and its document ids, when given)."""
        if not self.splits_documents:
            return plan
        return plan.for_documents(self.documents(tokens, document_ids), mask=self.reset_attention_mask,
                                  reset_position_ids=self.reset_position_ids)

    def loss_mask(self, tokens: torch.Tensor, loss_mask: torch.Tensor, target_shift: int = 0) -> torch.Tensor:
        """`loss_mask` (indexed by target token) under --eod-mask-loss: Megatron's rule, no target
        for a row that reads an EOD (`loss_mask[data == eod] = 0` per row). The row at p reads
        token p and predicts token p + `target_shift` (`Objective.target_shift`): for block
        diffusion (0) the EOD itself is no target; for AR and Fast-dLLM v2 (1) the token after an
        EOD, the next document's first, is none. Idempotent."""
        if not self.eod_mask_loss:
            return loss_mask
        reads_eod = (tokens != self.eod_token_id).to(loss_mask.dtype)
        if target_shift == 0:
            return loss_mask * reads_eod
        out = loss_mask.clone()
        out[..., target_shift:] = out[..., target_shift:] * reads_eod[..., :-target_shift]
        return out
