"""The training forward of `diffusiongemma-sft` on one rank (layout `single`).

`DiffusionGemmaSFTModel` is a `BlockDiffusionModel` whose rows are [canvas noisy rows ; clean
rows]: only blocks from the micro-batch's first response block on get a noisy copy (a noisy block
is attended by nobody but itself, so dropping the prompt blocks' copies changes no loss term, it
only removes their work). It runs the optional self-conditioning first pass (no grad, canvas
logits only), then the second pass with logits for every row, and sums the canvas loss and the
clean-stream AR loss over the same denominator.

Other layouts need the canvas-subset plan from the layout (see docs/diffusiongemma.md); until
then this class refuses them.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state as mpu

from megatron_csbp.attention.block_attention import AttentionPlan
from megatron_csbp.attention.core_attention import plan_mask
from megatron_csbp.layout.masks import RowMeta
from megatron_csbp.model.bdlm import BlockDiffusionModel, LossOutput
from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective


class DiffusionGemmaSFTModel(BlockDiffusionModel):
    def __init__(self, gpt, objective: DiffusionGemmaSFTObjective, layout, **kwargs):
        if layout.kind != "single":
            raise NotImplementedError(
                f"diffusiongemma-sft runs on layout 'single' for now (got {layout.kind!r}): canvas-only noisy rows "
                "under CP/BP/CSBP need the layout's canvas-subset plans")
        if layout.geometry.clean_attention != "token_causal":
            raise ValueError("DiffusionGemma's clean stream is token-causal (--clean-attention token_causal)")
        if objective.block_size != layout.geometry.block_size:
            raise ValueError(f"objective block size {objective.block_size} != layout block size {layout.geometry.block_size}")
        super().__init__(gpt, objective, layout, **kwargs)
        self._canvas_plans: Dict[int, AttentionPlan] = {}

    def canvas_plan(self, first_block: int) -> AttentionPlan:
        if first_block not in self._canvas_plans:
            g = self.layout.geometry
            noisy = torch.arange(first_block * g.block_size, g.seq_length)
            self._canvas_plans[first_block] = AttentionPlan(g, RowMeta.of(noisy, torch.arange(g.seq_length)))
        return self._canvas_plans[first_block]

    @staticmethod
    def _agree_with_expert_peers(first_block: int, any_sc: bool):
        """Ranks that exchange tokens in MoE layers (the expert tensor-and-model-parallel group)
        hold different samples but must issue the same collectives with the same shapes: they
        agree on the earliest canvas block (MIN) and on running the self-conditioning pass (MAX).
        Extra canvas blocks carry no loss and a first pass for a sample without self-conditioning
        is masked out, so the loss is unchanged."""
        if not (dist.is_initialized() and mpu.model_parallel_is_initialized()):
            return first_block, any_sc
        group = mpu.get_expert_tensor_and_model_parallel_group(check_initialized=False)
        if group is None or dist.get_world_size(group) == 1:
            return first_block, any_sc
        t = torch.tensor([-first_block, int(any_sc)], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(-t[0]), bool(t[1])

    def _run(self, ids, positions, plan, keep_rows: Optional[int], **model_kwargs):
        self._num_logit_rows = keep_rows
        try:
            return self.gpt(ids, positions[None].expand_as(ids), attention_mask=plan_mask(plan), **model_kwargs)
        finally:
            self._num_logit_rows = None

    def forward(self, tokens, loss_mask=None, sample_index=None, denominator=None) -> LossOutput:
        b, L = tokens.shape
        if L != self.layout.geometry.seq_length:
            raise ValueError(f"batch has sequence length {L}, the layout was built for {self.layout.geometry.seq_length}")
        if loss_mask is None:
            raise ValueError("diffusiongemma-sft needs a loss mask (1 on response tokens)")
        if sample_index is None:
            sample_index = torch.arange(b)
        if denominator is None:
            denominator = self.objective.denominator(loss_mask)
        noised = self.objective.noise(tokens, loss_mask, sample_index)
        first_block, any_sc = self._agree_with_expert_peers(noised.first_canvas_block, bool(noised.self_conditioning.any()))
        plan = self.canvas_plan(first_block)
        rows = plan.local
        dev = tokens.device
        pos, is_clean = rows.position.to(dev), rows.is_clean.to(dev)
        n = int((~is_clean).sum())
        ids = torch.where(is_clean[None], tokens[:, pos], noised.noisy_tokens[:, pos])
        self.gpt.rotary_pos_emb.positions = pos
        sc_kwargs = {}
        if n and any_sc:
            with torch.no_grad():
                first = self._run(ids, pos, plan, n)
            sc_kwargs = dict(self_conditioning_logits=first.detach(), self_conditioning_mask=noised.self_conditioning)
        logits = self._run(ids, pos, plan, None, **sc_kwargs)
        # One cross entropy over every row ([canvas ; clean]): Megatron's vocab-parallel CE works in
        # place on its input, so two calls on slices of the same logits would clash in backward.
        noisy_pos, clean_pos = pos[:n], pos[n:]
        targets = torch.cat([noised.targets[:, noisy_pos], noised.clean_targets[:, clean_pos]], dim=1)
        weights = torch.cat([noised.weights[:, noisy_pos], noised.clean_weights[:, clean_pos]], dim=1)
        return self.loss(logits, targets, weights, denominator)
