"""`BlockDiffusionModel`: a Megatron `GPTModel` (any spec with the block attention swapped in)
trained as a block diffusion LM.

A forward is noise -> plan -> rows -> model -> loss: the objective noises the batch; the plan is
the rank's rows of the layout (or of a canvas of it); the layout's `RowFeeder` (layout/feed.py)
gives this rank's rows ([owned noisy ; clean]) with their shared positions and the rows that carry
a target; `logits` runs the GPT model and keeps only the rows that reach the output layer (a
pre-hook on the output layer drops the clean rows: half the output GEMM, no fp32 logits for them);
`loss` (model/loss.py) returns this rank's partial loss over the global denominator. Summing it
over the shard group gives the full loss. Under pipeline parallelism every stage runs the same
noise -> plan -> rows (keyed by the sample index; megatron_csbp/pipeline.py); a stage before the
last returns its hidden states of this rank's rows for the next stage instead of a loss.

Objectives may ask for more through their `NoisedBatch` (DiffusionGemma SFT uses all three):
- `first_canvas_block`: noisy rows only for blocks from there on (the layout's `canvas_layout`;
  plans are cached per canvas start, at most `layout.feed.CANVAS_PLAN_CACHE` of them besides the
  model's own, least recently used evicted: each holds its masks' row vectors and tile tables);
- `clean_targets` / `clean_weights` (objective flag `needs_clean_logits`): a loss on clean rows;
  each clean row is counted by one rank of the shard group (`SequenceLayout.clean_loss_positions`)
  and only the counted rows that carry a target in the micro-batch reach the output layer (under
  sequence parallelism: each TP shard keeps its noisy chunk and its chosen clean rows, padded to
  one count for the all-gather; see `layout.feed.sequence_parallel_logit_rows`);
- `self_conditioning` ([b] bool): when any sample draws it, a no-grad first pass gives the noisy
  rows' logits, fed to the second pass as `self_conditioning_logits` (+ the per-sample mask).
The canvas start and whether the first pass runs follow from the samples alone, so every rank of
the shard group (same samples) computes the same; ranks that exchange MoE tokens across
different samples agree on them (MIN / MAX, `parallel_state.agree_with_expert_peers`) before any
other collective.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Optional

import torch

from megatron.core import parallel_state as mpu

from megatron_csbp.attention.block_attention import AttentionPlan
from megatron_csbp.attention.plan_handles import plan_mask
from megatron_csbp.layout.feed import OutputRows, RowFeeder
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.packing import Packing
from megatron_csbp.model.hybrid import count_gated_delta_layers
from megatron_csbp.model.loss import LossOutput, weighted_cross_entropy
from megatron_csbp.model.rotary import LayoutRotaryEmbedding
from megatron_csbp.model.spec import count_block_attention
from megatron_csbp.objectives.base import NoisedBatch, Objective
from megatron_csbp.parallel_state import agree_with_expert_peers, has_expert_parallel_peers
from megatron_csbp.utils.precision import compute_dtype


class BlockDiffusionModel(torch.nn.Module):
    def __init__(self, gpt: torch.nn.Module, objective: Objective, layout: SequenceLayout,
                 shard_rank: int = 0, ring_group=None, transport: str = "allgather",
                 packing: Optional[Packing] = None):
        super().__init__()
        if count_block_attention(gpt) == 0 and count_gated_delta_layers(gpt) == 0:
            raise ValueError("the GPT model has no BlockDiffusionAttention or BlockDiffusionGatedDeltaNet: build it "
                             "from with_block_diffusion_attention(spec) or model.hybrid.hybrid_block_spec")
        if getattr(gpt, "mtp_process", False):
            raise ValueError("multi-token prediction rolls labels over the CP group: not supported with block diffusion")
        if gpt.position_embedding_type == "rope":
            if not isinstance(gpt.rotary_pos_emb, LayoutRotaryEmbedding):
                gpt.rotary_pos_emb = LayoutRotaryEmbedding(gpt.rotary_pos_emb, compute_dtype(gpt.config.params_dtype))
        elif gpt.position_embedding_type != "none":
            raise ValueError(f"--position-embedding-type {gpt.position_embedding_type} is not supported (use rope or none)")
        objective.check_vocab(gpt.vocab_size)
        if packing is not None and packing.reset_attention_mask and count_gated_delta_layers(gpt):
            raise ValueError("--reset-attention-mask is not supported with Gated DeltaNet layers (their recurrence "
                             "would carry state across documents)")
        self.packing = packing
        if getattr(objective, "needs_clean_logits", False) and not layout.clean_loss:
            layout = replace(layout, clean_loss=True)
        self.gpt, self.objective, self.layout = gpt, objective, layout
        # Megatron's TP sequence parallelism splits the rows over the TP ranks (shard-major order).
        tp_shards = gpt.config.tensor_model_parallel_size if gpt.config.sequence_parallel else 1
        self.feeder = RowFeeder(layout, shard_rank, ring_group, transport, objective.uses_noisy_stream, tp_shards,
                                mpu.get_tensor_model_parallel_rank() if tp_shards > 1 else 0)
        self._output: Optional[OutputRows] = None  # set by `logits` for its forward only
        # self-conditioning's first pass on the last pipeline stage: the output layer's input is
        # kept here and the output layer gets no rows (forward(first_pass=True))
        self._captured: Optional[list] = None
        # Pipeline parallelism (megatron_csbp/pipeline.py): only the last stage has the output layer.
        self.last_stage = getattr(gpt, "post_process", True)
        if self.last_stage:
            gpt.output_layer.register_forward_pre_hook(self._keep_logit_rows)
            gpt.output_layer.register_forward_hook(self._order_logit_rows)

    @property
    def whole_model(self) -> bool:
        """Whether this is the whole model (no pipeline stage before or after it)."""
        return self.last_stage and getattr(self.gpt, "pre_process", True)

    @property
    def plan(self) -> AttentionPlan:
        """This rank's plan of the whole layout (canvas start `layout.canvas_start`)."""
        return self.feeder.plan

    def canvas_plan(self, first_block: int) -> AttentionPlan:
        """This rank's plan with noisy rows from block `first_block` on (see `RowFeeder.canvas_plan`)."""
        return self.feeder.canvas_plan(first_block, balanced=has_expert_parallel_peers())

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
                sample_index: Optional[torch.Tensor] = None,
                denominator: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None,
                self_conditioning: Optional[torch.Tensor] = None, first_pass: bool = False) -> LossOutput:
        """`document_ids` [b, L] (packed SFT): the samples' documents, instead of their EOD tokens.

        Under pipeline parallelism self-conditioning runs in two schedules
        (megatron_csbp/pipeline_self_conditioning.py): `first_pass=True` is its no-grad first pass
        (a stage before the last returns hidden states, the last its output-layer input for the
        noisy rows, [noisy rows (/TP under SP), b, h], never the logits); then the first stage's
        training forward gets that as `self_conditioning`."""
        self.feeder.check_sequence_length(tokens)
        if loss_mask is None:
            loss_mask = torch.ones_like(tokens)
        if sample_index is None:
            sample_index = torch.arange(tokens.shape[0])
        loss_mask = self.supervised(tokens, loss_mask)
        if denominator is None:
            denominator = self.objective.denominator(loss_mask)
        if self.packing is not None and self.packing.splits_documents and tokens.shape[0] > 1:
            ids = [None] * tokens.shape[0] if document_ids is None else list(document_ids)
            docs = [self.packing.documents(t, i) for t, i in zip(tokens, ids)]
            if any(d != docs[0] for d in docs[1:]):
                # Each packed sample has its own documents, hence its own plan: one forward per
                # sample. The loss is a sum over target rows divided by the global denominator,
                # and noise is keyed by the sample index, so the sum is the micro-batch's loss.
                return self._sample_by_sample(tokens, loss_mask, sample_index, denominator, document_ids)
        noised, plan, any_sc, rows = self._rows_of(tokens, loss_mask, sample_index, document_ids)
        if first_pass:
            # Pipeline stage of self-conditioning's first pass (no grad; see the docstring).
            with torch.no_grad():
                if not self.last_stage:
                    return self.logits(rows.input_ids, plan)
                self._captured = []
                try:
                    self.logits(rows.input_ids, plan)
                    if self._captured:
                        return self._captured[0]
                    # no noisy rows here (a micro-batch that pads an interleaved first pass)
                    w = self.gpt.shared_embedding_or_output_weight()
                    return w.new_zeros((0, tokens.shape[0], w.shape[1]))
                finally:
                    self._captured = None
        model_kwargs = {}
        if any_sc and rows.num_noisy and self.whole_model:
            # Self-conditioning: a detached first pass gives the noisy rows' logits.
            with torch.no_grad():
                first_logits = self.logits(rows.input_ids, plan)
            model_kwargs = dict(self_conditioning_logits=first_logits.detach(),
                                self_conditioning_mask=noised.self_conditioning)
        elif any_sc and rows.num_noisy and getattr(self.gpt, "pre_process", True):
            if self_conditioning is None:
                raise ValueError("self-conditioning under --pipeline-model-parallel-size > 1: the first stage got no "
                                 "hidden states from the first pass (pipeline_self_conditioning.SelfConditioningRelay)")
            model_kwargs = dict(self_conditioning_hidden=self_conditioning,
                                self_conditioning_mask=noised.self_conditioning)
        logits = self.logits(rows.input_ids, plan, rows.logit_rows, **model_kwargs)
        if not self.last_stage:
            return logits  # pipeline stage before the last: hidden states [rows (/ TP), b, h] of this rank's rows
        # AR on k replicated clean rings: each ring computes the full loss, so each counts 1/k.
        return self.loss(logits, rows.targets, rows.weights, denominator * self.feeder.replication)

    def _sample_by_sample(self, tokens, loss_mask, sample_index, denominator, document_ids):
        """One forward per sample of a micro-batch whose samples have different documents. The last
        stage sums the samples' losses (each over the global denominator); a pipeline stage before
        the last concatenates their hidden states along the batch ([rows, b, h], what megatron-core
        sends), and a stage after the first gives each sample its slice of the received tensor."""
        decoder = getattr(self.gpt, "decoder", None)
        received = getattr(decoder, "input_tensor", None) if not getattr(self.gpt, "pre_process", True) else None
        outs = []
        try:
            for i in range(tokens.shape[0]):
                if received is not None:
                    decoder.set_input_tensor(received[:, i:i + 1])
                outs.append(self.forward(tokens[i:i + 1], loss_mask[i:i + 1], sample_index[i:i + 1], denominator,
                                         None if document_ids is None else document_ids[i:i + 1]))
        finally:
            if received is not None:
                decoder.set_input_tensor(received)
        if not self.last_stage:
            if any(o.shape[0] != outs[0].shape[0] for o in outs):
                raise ValueError("packed documents (--reset-attention-mask / --reset-position-ids) under "
                                 "--pipeline-model-parallel-size > 1 with samples whose rows differ (--objective "
                                 f"{self.objective.name}): use --micro-batch-size 1")
            return torch.cat(outs, dim=1)
        return LossOutput(*(sum(getattr(o, f) for o in outs) for f in ("loss", "num_targets", "weighted_sum")))

    def _rows_of(self, tokens, loss_mask, sample_index, document_ids):
        """(noised batch, plan, whether the self-conditioning first pass runs, this rank's rows)."""
        noised = self.objective.noise(tokens, loss_mask, sample_index)
        plan, any_sc = self._plan_of(noised)
        if self.packing is not None:
            plan = self.feeder.packed_plan(plan, self.packing, tokens[0],
                                           None if document_ids is None else document_ids[0])
        return noised, plan, any_sc, self.feeder.rows(plan, noised, tokens)

    def draws_self_conditioning(self, tokens, loss_mask, sample_index, document_ids=None) -> bool:
        """Whether a micro-batch (its loss mask already `supervised`) runs the self-conditioning
        first pass on this rank: every stage of a pipeline answers the same (same samples, same
        draws, same rows); expert-parallel peers agree (`_plan_of`)."""
        _, _, any_sc, rows = self._rows_of(tokens, loss_mask, sample_index, document_ids)
        return bool(any_sc and rows.num_noisy)

    def supervised(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The loss mask this model trains on: under --eod-mask-loss less the targets of rows that
        read an EOD (`Packing.loss_mask`), and less data tokens equal to the mask id (never a
        target: the mask column is out of the softmax). What the trainer's denominator counts, and
        the rule `megatron_lm.bdlm_batch` applies to Megatron-LM's batch, so both count the same
        supervised tokens."""
        return supervised_mask(tokens, loss_mask, self.packing, self.objective.mask_token_id,
                               self.objective.target_shift)

    def _plan_of(self, noised: NoisedBatch):
        """(plan, whether the self-conditioning first pass runs) of a noised batch; the canvas
        start and the first pass agreed with expert-parallel peers."""
        sc = noised.self_conditioning
        any_sc = sc is not None and bool(sc.any())
        if noised.first_canvas_block is None and sc is None:
            return self.plan, any_sc
        first = self.layout.canvas_start if noised.first_canvas_block is None else noised.first_canvas_block
        first, any_sc = agree_with_expert_peers(first, any_sc)
        plan = self.plan if noised.first_canvas_block is None else self.canvas_plan(first)
        return plan, any_sc

    # ---- logits ----------------------------------------------------------------------------------
    def logits(self, tokens: torch.Tensor, plan: Optional[AttentionPlan] = None,
               logit_rows: Optional[torch.Tensor] = None, **model_kwargs) -> torch.Tensor:
        """Logits [b, rows, vocab / TP] of this rank's rows under `plan` (default: the model's).

        `tokens` [b, len(plan.local)]: the ids of the plan's rows in local row order. The rows
        that come back are its noisy rows in local order (every row when it has none, AR), or
        `logit_rows` (local row indices: every noisy row in order, then chosen clean rows) in
        that order. Positions, the physical row order under sequence parallelism and the
        selection before the output layer are handled here (`RowFeeder.feed`)."""
        plan = self.plan if plan is None else plan
        fed = self.feeder.feed(plan, tokens, logit_rows)
        rope = self.gpt.rotary_pos_emb.at(fed.positions) if self.gpt.position_embedding_type == "rope" \
            else contextlib.nullcontext()
        self._output = fed.output
        try:
            with rope:
                return self.gpt(fed.input_ids, fed.positions[None].expand_as(fed.input_ids),
                                attention_mask=plan_mask(plan), **model_kwargs)
        finally:
            self._output = None

    def _keep_logit_rows(self, module, args):
        out = self._output
        if out is None:
            return None
        if out.keep is not None:
            hidden = args[0].index_select(0, out.keep.to(args[0].device))
        elif out.count is not None:
            hidden = args[0][: out.count]
        else:
            return None
        if self._captured is not None:
            self._captured.append(hidden)
            hidden = hidden[:0]
        return (hidden,) + tuple(args[1:])

    def _order_logit_rows(self, module, args, output):
        """Sequence parallelism with `logit_rows`: the all-gathered rows [shard 0's k | shard 1's k
        | ...] -> the requested order, padding dropped."""
        if self._output is None or self._output.gathered_order is None:
            return None
        logits, bias = output
        return logits.index_select(0, self._output.gathered_order.to(logits.device)), bias

    # ---- loss ------------------------------------------------------------------------------------
    def loss(self, logits, targets, weights, denominator) -> LossOutput:
        """sum(w * CE over target rows) / denominator, vocab-parallel under TP."""
        exclude = self.objective.mask_token_id if self.objective.exclude_mask_from_softmax else None
        return weighted_cross_entropy(logits, targets, weights, denominator, exclude_token=exclude)


def supervised_mask(tokens: torch.Tensor, loss_mask: torch.Tensor, packing: Optional[Packing],
                    mask_token_id: Optional[int], target_shift: int = 0) -> torch.Tensor:
    """The supervised tokens of a sequence: `loss_mask` less, under --eod-mask-loss, the targets
    of rows that read an EOD (`Packing.loss_mask`), and less data tokens equal to the mask id (the
    mask column is out of the softmax). Idempotent. The one rule of the trainer
    (`BlockDiffusionModel.supervised`) and of Megatron-LM's batches (`megatron_lm.bdlm_batch`)."""
    if packing is not None:
        loss_mask = packing.loss_mask(tokens, loss_mask, target_shift)
    return loss_mask if mask_token_id is None else loss_mask * (tokens != mask_token_id).to(loss_mask.dtype)


def wrapper_class(objective: Objective) -> type:
    """The `BlockDiffusionModel` (sub)class `objective` trains: its `model_wrapper` ("module:Class"),
    else `BlockDiffusionModel`. The objective names it so that `objectives/` never imports `model/`."""
    if objective.model_wrapper is None:
        return BlockDiffusionModel
    import importlib

    module, _, name = objective.model_wrapper.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, BlockDiffusionModel)):
        raise TypeError(f"--objective {objective.name}: model_wrapper {objective.model_wrapper} is not a BlockDiffusionModel")
    return cls
