"""`ModelChunk`: what the `Trainer` needs from one model chunk (docs/architecture.md#one-training-step).

Implemented by `training.model.TrainableBDLM` (a `BlockDiffusionModel`) and `model.dflash.TrainableDrafter`.
Every step method takes the objective it runs explicitly and keeps nothing between calls; an
evaluation's metrics travel in an accumulator the caller passes in and gets back.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Tuple, runtime_checkable

import torch

from megatron_csbp.model.loss import LossOutput
from megatron_csbp.objectives.base import Objective

#: an evaluation's sums by name (e.g. the DFlash drafter's acceptance counts); {} to start
Metrics = Dict[str, torch.Tensor]


@runtime_checkable
class ModelChunk(Protocol):
    config: Any  # its megatron-core TransformerConfig
    objective: Objective  # the objective it trains
    last_stage: bool  # returns losses; a stage before the last returns what the next stage reads
    plan: Any  # the rows that cross a pipeline stage (None: they vary per micro-batch)

    def supervised(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The loss mask it trains on (what the trainer's denominator counts)."""

    def training_loss(self, tokens, loss_mask, sample_index, denominator, document_ids=None, self_conditioning=None,
                      objective: Optional[Objective] = None) -> LossOutput:
        """The last stage's partial loss of a micro-batch under `objective` (None: its own)."""

    def stage_output(self, tokens, loss_mask, sample_index, denominator, document_ids=None, self_conditioning=None,
                     objective: Optional[Objective] = None) -> torch.Tensor:
        """A stage before the last: what it sends to the next stage."""

    def evaluation_loss(self, tokens, loss_mask, sample_index, denominator, document_ids=None, *,
                        objective: Objective, metrics: Metrics) -> Tuple[LossOutput, Metrics]:
        """The last stage's held-out loss under `objective`, and `metrics` with this micro-batch's added."""

    def eval_record(self, metrics: Metrics) -> Dict[str, Any]:
        """Collective on every rank after an evaluation: the fields it adds to the evaluation's record."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """The state a checkpoint holds."""
