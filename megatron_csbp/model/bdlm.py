"""`BlockDiffusionModel`: a Megatron `GPTModel` (any spec with the block attention swapped in)
trained as a block diffusion LM.

A forward is noise -> plan -> rows -> model -> loss; one method per mode (`training_loss`,
`stage_output`, `first_pass`), each under the objective it is given. The model, the `NoisedBatch`
extras (canvas, clean-row loss, self-conditioning) and expert-peer agreement: docs/semantics.md#the-model-modelbdlmpy,
docs/diffusiongemma.md, docs/architecture.md#one-training-step.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from functools import partial
from typing import Dict, Optional, Tuple

import torch

from megatron.core import parallel_state as mpu

from megatron_csbp.attention.block_attention import AttentionPlan
from megatron_csbp.attention.plan_handles import plan_mask
from megatron_csbp.attention.feed import OutputRows, RowFeeder
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.packing import Packing
from megatron_csbp.model.hybrid import count_gated_delta_layers
from megatron_csbp.model.loss import LossOutput, weighted_cross_entropy
from megatron_csbp.model.rotary import LayoutRotaryEmbedding
from megatron_csbp.model.spec import count_block_attention
from megatron_csbp.objectives.base import NoisedBatch, Objective
from megatron_csbp.parallel.state import agree_with_expert_peers, has_expert_parallel_peers
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
        # Pipeline parallelism (pipeline.py): the embedding on the first stage, the output layer on the last.
        self.first_stage, self.last_stage = getattr(gpt, "pre_process", True), getattr(gpt, "post_process", True)

    @property
    def plan(self) -> AttentionPlan:
        """This rank's plan of the whole layout (canvas start `layout.canvas_start`)."""
        return self.feeder.plan

    def canvas_plan(self, first_block: int) -> AttentionPlan:
        """This rank's plan with noisy rows from block `first_block` on (see `RowFeeder.canvas_plan`)."""
        return self.feeder.canvas_plan(first_block, balanced=has_expert_parallel_peers())

    # ---- the modes (`model.contract.ModelChunk` through `training.model.TrainableBDLM`) --------------
    def forward(self, tokens: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
                sample_index: Optional[torch.Tensor] = None, denominator: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None, self_conditioning: Optional[torch.Tensor] = None):
        """What megatron-core's schedules call: `training_loss` on the last stage (or the whole
        model), `stage_output` before it. `document_ids` [b, L] (packed SFT): the samples'
        documents, instead of their EOD tokens."""
        mode = self.training_loss if self.last_stage else self.stage_output
        return mode(tokens, loss_mask, sample_index, denominator, document_ids, self_conditioning)

    def training_loss(self, tokens, loss_mask=None, sample_index=None, denominator=None, document_ids=None,
                      self_conditioning=None, objective: Optional[Objective] = None) -> LossOutput:
        """The last stage's (or the whole model's) training forward under `objective` (None: the
        model's): this rank's partial loss over `denominator`."""
        return self._run(self._loss, objective, tokens, loss_mask, sample_index, denominator, document_ids,
                         self_conditioning)

    def stage_output(self, tokens, loss_mask=None, sample_index=None, denominator=None, document_ids=None,
                     self_conditioning=None, objective: Optional[Objective] = None) -> torch.Tensor:
        """A pipeline stage before the last: hidden states [rows (/ TP), b, h] of this rank's rows."""
        return self._run(self._hidden, objective, tokens, loss_mask, sample_index, denominator, document_ids,
                         self_conditioning)

    @torch.no_grad()
    def first_pass(self, tokens, loss_mask=None, sample_index=None, denominator=None, document_ids=None,
                   self_conditioning=None, objective: Optional[Objective] = None) -> torch.Tensor:
        """Self-conditioning's first pass under pipeline parallelism (parallel/self_conditioning.py):
        hidden states on a stage before the last; on the last its output layer's input of the noisy
        rows, [noisy rows (/ TP under SP), b, h] (the output layer gets no rows), which the first
        stage's `stage_output` then gets as `self_conditioning`."""
        return self._run(self._first_pass, objective, tokens, loss_mask, sample_index, denominator, document_ids,
                         self_conditioning)

    def evaluation_loss(self, tokens, loss_mask, sample_index, denominator, document_ids=None, *,
                        objective: Objective, metrics: Dict) -> Tuple[LossOutput, Dict]:
        """The held-out loss under `objective`; a block diffusion LM adds no metrics."""
        return self.training_loss(tokens, loss_mask, sample_index, denominator, document_ids, objective=objective), metrics

    def eval_record(self, metrics: Dict) -> Dict:
        return {}

    def _run(self, mode, objective, tokens, loss_mask, sample_index, denominator, document_ids, self_conditioning):
        """`mode` with the defaults filled in; per sample when packed samples have different documents."""
        objective = self.objective if objective is None else objective
        self.feeder.check_sequence_length(tokens)
        loss_mask = self.supervised(tokens, torch.ones_like(tokens) if loss_mask is None else loss_mask)
        sample_index = torch.arange(tokens.shape[0]) if sample_index is None else sample_index
        if denominator is None:
            denominator = objective.denominator(loss_mask, tokens, document_ids)
        args = (tokens, loss_mask, sample_index, denominator, document_ids, self_conditioning)
        if self.packing is not None and self.packing.splits_documents and tokens.shape[0] > 1:
            ids = [None] * tokens.shape[0] if document_ids is None else list(document_ids)
            docs = [self.packing.documents(t, i) for t, i in zip(tokens, ids)]
            if any(d != docs[0] for d in docs[1:]):
                return self._sample_by_sample(partial(mode, objective), *args)
        return mode(objective, *args)

    def _loss(self, objective, tokens, loss_mask, sample_index, denominator, document_ids, hidden) -> LossOutput:
        rows, logits = self._through_model(objective, tokens, loss_mask, sample_index, document_ids, hidden)
        # AR on k replicated clean rings: each ring computes the full loss, so each counts 1/k.
        denominator, weights = denominator * self.feeder.replication, rows.weights
        if denominator.dim() and denominator.numel() == 2:  # [noisy rows', clean rows'] (Objective.denominator)
            n = rows.num_noisy
            weights = torch.cat([weights[:, :n] / denominator[0], weights[:, n:] / denominator[1].clamp_min(1)], 1)
            denominator = denominator.new_ones(())
        return self.loss(logits, rows.targets, weights, denominator)

    def _hidden(self, objective, tokens, loss_mask, sample_index, denominator, document_ids, hidden) -> torch.Tensor:
        return self._through_model(objective, tokens, loss_mask, sample_index, document_ids, hidden)[1]

    def _first_pass(self, objective, tokens, loss_mask, sample_index, denominator, document_ids, hidden):
        _, plan, _, rows = self._rows_of(tokens, loss_mask, sample_index, document_ids, objective)
        if not self.last_stage:
            return self.logits(rows.input_ids, plan)
        captured = []
        self.logits(rows.input_ids, plan, capture=captured)
        w = self.gpt.shared_embedding_or_output_weight()  # nothing captured: no noisy rows (a padding micro-batch)
        return captured[0] if captured else w.new_zeros((0, tokens.shape[0], w.shape[1]))

    def _through_model(self, objective, tokens, loss_mask, sample_index, document_ids, hidden):
        """(this rank's rows, the GPT model's output on them) of a training forward. When the batch
        draws self-conditioning and this rank has noisy rows, the GPT model also gets, on the whole
        model, a detached first pass's logits of the noisy rows, on the first pipeline stage the
        first pass's `hidden` (`first_pass`)."""
        noised, plan, any_sc, rows = self._rows_of(tokens, loss_mask, sample_index, document_ids, objective)
        sc = {}
        if any_sc and rows.num_noisy and self.first_stage:
            if self.last_stage:
                with torch.no_grad():
                    sc = dict(self_conditioning_logits=self.logits(rows.input_ids, plan).detach())
            elif hidden is None:
                raise ValueError("self-conditioning under --pipeline-model-parallel-size > 1: the first stage got no "
                                 "hidden states from the first pass (pipeline_self_conditioning.SelfConditioningRelay)")
            else:
                sc = dict(self_conditioning_hidden=hidden)
            sc["self_conditioning_mask"] = noised.self_conditioning
        return rows, self.logits(rows.input_ids, plan, rows.logit_rows, **sc)

    def _sample_by_sample(self, mode, tokens, loss_mask, sample_index, denominator, document_ids, self_conditioning):
        """`mode` per sample of a micro-batch whose samples have different documents (own plans).
        Noise is keyed by the sample index and every loss is over the global denominator, so the
        losses sum to the micro-batch's; tensors ([rows, b, h], what megatron-core sends) join along
        the batch, and a stage after the first gives each sample its slice of the received tensor."""
        decoder = getattr(self.gpt, "decoder", None)
        received = None if self.first_stage else getattr(decoder, "input_tensor", None)
        outs = []
        try:
            for i in range(tokens.shape[0]):
                one = slice(i, i + 1)
                if received is not None:
                    decoder.set_input_tensor(received[:, one])
                outs.append(mode(tokens[one], loss_mask[one], sample_index[one], denominator,
                                 None if document_ids is None else document_ids[one],
                                 None if self_conditioning is None else self_conditioning[:, one]))
        finally:
            if received is not None:
                decoder.set_input_tensor(received)
        if isinstance(outs[0], LossOutput):
            return LossOutput(*(sum(getattr(o, f) for o in outs) for f in ("loss", "num_targets", "weighted_sum")))
        if any(o.shape[0] != outs[0].shape[0] for o in outs):
            raise ValueError("packed documents (--reset-attention-mask / --reset-position-ids) under "
                             "--pipeline-model-parallel-size > 1 with samples whose rows differ (--objective "
                             f"{self.objective.name}): use --micro-batch-size 1")
        return torch.cat(outs, dim=1)

    def _rows_of(self, tokens, loss_mask, sample_index, document_ids, objective: Optional[Objective] = None):
        """(noised batch, plan, whether the self-conditioning first pass runs, this rank's rows)."""
        objective = self.objective if objective is None else objective
        docs = {"document_ids": document_ids} if objective.reads_documents else {}
        noised = objective.noise(tokens, loss_mask, sample_index, **docs)
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
               logit_rows: Optional[torch.Tensor] = None, capture: Optional[list] = None,
               **model_kwargs) -> torch.Tensor:
        """Logits [b, rows, vocab / TP] of this rank's rows under `plan` (default: the model's); on a
        pipeline stage before the last, the GPT model's hidden states [rows (/ TP), b, h].

        `tokens` [b, len(plan.local)]: the ids of the plan's rows in local row order. The rows
        that come back are its noisy rows in local order (every row when it has none, AR), or
        `logit_rows` (local row indices: every noisy row in order, then chosen clean rows) in
        that order. Positions, the physical row order under sequence parallelism and the
        selection before the output layer are handled here (`RowFeeder.feed`). `capture` (a list):
        the output layer's input of those rows is appended to it and the output layer gets none."""
        plan = self.plan if plan is None else plan
        fed = self.feeder.feed(plan, tokens, logit_rows)
        with contextlib.ExitStack() as scope:
            if self.gpt.position_embedding_type == "rope":
                scope.enter_context(self.gpt.rotary_pos_emb.at(fed.positions))
            if self.last_stage:  # the output layer's rows: a pre-hook bound to this call's rows, removed after it
                scope.callback(self.gpt.output_layer.register_forward_pre_hook(
                    partial(_keep_rows, fed.output, capture)).remove)
            out = self.gpt(fed.input_ids, fed.positions[None].expand_as(fed.input_ids),
                           attention_mask=plan_mask(plan), **model_kwargs)
        order = fed.output.gathered_order  # sequence parallelism with `logit_rows`: all-gathered rows
        if order is None or not self.last_stage:  # [shard 0's k | shard 1's k | ...] -> the requested order
            return out
        return out.index_select(1, order.to(out.device))

    # ---- loss ------------------------------------------------------------------------------------
    def loss(self, logits, targets, weights, denominator) -> LossOutput:
        """sum(w * CE over target rows) / denominator, vocab-parallel under TP; the mask column is
        left out as the model's objective says (like its rows, fixed when the model is built: an
        evaluation objective changes the noise only)."""
        exclude = self.objective.mask_token_id if self.objective.exclude_mask_from_softmax else None
        return weighted_cross_entropy(logits, targets, weights, denominator, exclude_token=exclude)


def _keep_rows(out: OutputRows, capture: Optional[list], module, args):
    """Output-layer pre-hook of one `logits` call: its input cut to the rows `out` keeps (all of
    them into `capture` instead, when given, and none to the output layer)."""
    if out.keep is not None:
        hidden = args[0].index_select(0, out.keep.to(args[0].device))
    elif out.count is not None:
        hidden = args[0][: out.count]
    else:
        return None
    if capture is not None:
        capture.append(hidden)
        hidden = hidden[:0]
    return (hidden,) + tuple(args[1:])


def supervised_mask(tokens: torch.Tensor, loss_mask: torch.Tensor, packing: Optional[Packing],
                    mask_token_id: Optional[int], target_shift: int = 0) -> torch.Tensor:
    """The supervised tokens of a sequence: `loss_mask` less, under --eod-mask-loss, the targets
    of rows that read an EOD (`Packing.loss_mask`), and less data tokens equal to the mask id (the
    mask column is out of the softmax). Idempotent. The one rule of the trainer
    (`BlockDiffusionModel.supervised`) and of Megatron-LM's batches (`megatron_lm.bdlm_batch`)."""
    if packing is not None:
        loss_mask = packing.loss_mask(tokens, loss_mask, target_shift)
    return loss_mask if mask_token_id is None else loss_mask * (tokens != mask_token_id).to(loss_mask.dtype)


#: objective class -> the `BlockDiffusionModel` subclass it trains (`register_wrapper`); objectives sit
#: below model/, so the model registers itself for its objective
WRAPPERS: Dict[type, type] = {}


def register_wrapper(objective: type):
    """Class decorator: `cls` is the model `objective` (an `Objective` subclass) trains."""
    def register(cls: type) -> type:
        WRAPPERS[objective] = cls
        return cls
    return register


def wrapper_class(objective: Objective) -> type:
    """The `BlockDiffusionModel` (sub)class `objective` trains: the one registered for its class (or
    a base of it), else `BlockDiffusionModel`."""
    return next((WRAPPERS[k] for k in type(objective).__mro__ if k in WRAPPERS), BlockDiffusionModel)
