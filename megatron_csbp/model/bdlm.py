"""`BlockDiffusionModel`: a Megatron `GPTModel` (any spec with the block attention swapped in)
trained as a block diffusion LM.

Per forward it builds this rank's rows from the layout ([owned noisy ; clean]), feeds them with
their shared positions, gets logits for the noisy rows only (a pre-hook on the output layer drops
the clean rows: half the output GEMM, no fp32 logits for them), and returns this rank's partial
loss over the global denominator. Summing it over the sequence group gives the full loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

from megatron_csbp.attention.block_attention import AttentionPlan, plan_for_layout
from megatron_csbp.attention.core_attention import plan_mask
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, RowMeta
from megatron_csbp.model.rotary import LayoutRotaryEmbedding
from megatron_csbp.model.spec import count_block_attention
from megatron_csbp.objectives.base import Objective


@dataclass
class LossOutput:
    loss: torch.Tensor  # this rank's partial loss (already divided by the global denominator)
    num_targets: torch.Tensor  # target rows on this rank
    weighted_sum: torch.Tensor  # sum of w * CE on this rank (before the division)


class BlockDiffusionModel(torch.nn.Module):
    def __init__(self, gpt: torch.nn.Module, objective: Objective, layout: SequenceLayout,
                 seq_rank: int = 0, ring_group=None, transport: str = "allgather"):
        super().__init__()
        if count_block_attention(gpt) == 0:
            raise ValueError("the GPT model has no BlockDiffusionAttention: build it from "
                             "with_block_diffusion_attention(spec)")
        if getattr(gpt, "mtp_process", False):
            raise ValueError("multi-token prediction rolls labels over the CP group: not supported with block diffusion")
        if gpt.position_embedding_type == "rope":
            if not isinstance(gpt.rotary_pos_emb, LayoutRotaryEmbedding):
                gpt.rotary_pos_emb = LayoutRotaryEmbedding(gpt.rotary_pos_emb)
        elif gpt.position_embedding_type != "none":
            raise ValueError(f"--position-embedding-type {gpt.position_embedding_type} is not supported (use rope or none)")
        objective.check_vocab(gpt.vocab_size)
        self.gpt, self.objective, self.layout = gpt, objective, layout
        self.seq_rank, self.ring_group, self.transport = seq_rank, ring_group, transport
        if objective.uses_noisy_stream:
            self.plan: AttentionPlan = plan_for_layout(layout, seq_rank, ring_group, transport)
            self.replication = 1
        else:
            self.plan, self.replication = autoregressive_plan(layout, seq_rank, ring_group, transport)
        self._num_logit_rows: Optional[int] = None
        self._sp_shards = self._sequence_parallel_shards(gpt.config)
        if self._sp_shards > 1:
            self.plan.physical_order = shard_major_order(self.plan.local, self._sp_shards)
        gpt.output_layer.register_forward_pre_hook(self._keep_noisy_rows)

    def _keep_noisy_rows(self, module, args):
        if self._num_logit_rows is None:
            return None
        hidden = args[0][: self._num_logit_rows]
        return (hidden,) + tuple(args[1:])

    @staticmethod
    def _sequence_parallel_shards(config) -> int:
        return config.tensor_model_parallel_size if config.sequence_parallel else 1

    def logits(self, input_ids: torch.Tensor, rows, **model_kwargs) -> torch.Tensor:
        """Logits [b, noisy rows, vocab / TP] of this rank's rows (ids in local row order).

        With sequence parallelism the rows are fed shard-major ([noisy | clean] per TP shard) so
        that every TP rank drops its clean rows alike before the output layer; the gathered logits
        come back in local noisy-row order."""
        num_noisy = int((~rows.is_clean).sum())
        positions = rows.position.to(input_ids.device)
        if self.plan.physical_order is not None:
            order = self.plan.physical_order.to(input_ids.device)
            input_ids, positions = input_ids[:, order], positions[order]
        if self.gpt.position_embedding_type == "rope":
            self.gpt.rotary_pos_emb.positions = positions
        # Logits for the noisy rows only; with no noisy stream (AR) for every row.
        self._num_logit_rows = num_noisy // self._sp_shards if num_noisy else None
        try:
            return self.gpt(input_ids, positions[None].expand_as(input_ids), attention_mask=plan_mask(self.plan),
                            **model_kwargs)
        finally:
            self._num_logit_rows = None

    def forward(self, tokens: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
                sample_index: Optional[torch.Tensor] = None,
                denominator: Optional[torch.Tensor] = None) -> LossOutput:
        b, L = tokens.shape
        if L != self.layout.geometry.seq_length:
            raise ValueError(f"batch has sequence length {L}, the layout was built for --seq-length "
                             f"{self.layout.geometry.seq_length}")
        if loss_mask is None:
            loss_mask = torch.ones_like(tokens)
        if sample_index is None:
            sample_index = torch.arange(b)
        if denominator is None:
            denominator = self.objective.denominator(loss_mask)
        noised = self.objective.noise(tokens, loss_mask, sample_index)
        if noised.clean_tokens is not None:
            tokens = noised.clean_tokens
        rows = self.plan.local
        pos = rows.position.to(tokens.device)
        is_clean = rows.is_clean.to(tokens.device)
        input_ids = torch.where(is_clean[None], tokens[:, pos], noised.noisy_tokens[:, pos])
        logits = self.logits(input_ids, rows)
        # Target rows: the noisy rows, or (AR) the clean rows.
        target_pos = pos[~is_clean] if self.objective.uses_noisy_stream else pos
        targets = noised.targets[:, target_pos]
        weights = noised.weights[:, target_pos]
        # AR on k replicated clean rings: each ring computes the full loss, so each counts 1/k.
        return self.loss(logits, targets, weights, denominator * self.replication)

    def loss(self, logits, targets, weights, denominator) -> LossOutput:
        """sum(w * CE over target rows) / denominator, vocab-parallel under TP."""
        logits_f = logits.float()
        if self.objective.exclude_mask_from_softmax:
            logits_f = self._exclude_token(logits_f, self.objective.mask_token_id)
        is_target = targets >= 0
        safe_targets = torch.where(is_target, targets, torch.zeros_like(targets))
        # Megatron's vocab-parallel CE wants [s, b, V/TP] (works for TP = 1 too) and rewrites its
        # input in place: never hand it a view of the model's own logits.
        logits_sb = logits_f.transpose(0, 1)
        logits_sb = logits_sb.clone() if logits_sb.data_ptr() == logits.data_ptr() else logits_sb.contiguous()
        ce = tensor_parallel.vocab_parallel_cross_entropy(
            logits_sb, safe_targets.transpose(0, 1).contiguous()
        ).transpose(0, 1)
        weighted = (ce * weights * is_target).sum()
        # A rank whose rows hold no target still returns a loss attached to every parameter.
        loss = weighted / denominator + 0.0 * logits.sum()
        return LossOutput(loss, is_target.sum(), weighted.detach())

    @staticmethod
    def _exclude_token(logits_f: torch.Tensor, token_id: int) -> torch.Tensor:
        local_vocab = logits_f.shape[-1]
        start = mpu.get_tensor_model_parallel_rank() * local_vocab if mpu.model_parallel_is_initialized() else 0
        if start <= token_id < start + local_vocab:
            logits_f = logits_f.index_fill(-1, torch.tensor([token_id - start], device=logits_f.device), float("-inf"))
        return logits_f


def autoregressive_plan(layout: SequenceLayout, seq_rank: int, ring_group, transport: str):
    """Clean stream only, token-causal: each ring holds a zigzag copy of the stream (CP ranks), so
    AR runs under every layout. Returns (plan, number of rings that compute the same loss)."""
    g = layout.geometry
    geometry = BlockGeometry(g.seq_length, g.block_size, "token_causal", g.window)
    empty = torch.zeros(0, dtype=torch.long)
    if layout.ring_size == 1:
        plan = AttentionPlan(geometry, RowMeta.of(empty, torch.arange(g.seq_length)))
    else:
        ring_position = layout.ring_of(seq_rank)[1]
        local = RowMeta.of(empty, layout.clean_shard_positions(ring_position))
        shards = layout.ring_clean_rows(seq_rank)
        plan = AttentionPlan(geometry, local, "clean", transport, ring_group, shards, shards, ring_position)
    return plan, layout.group_size // layout.ring_size


def shard_major_order(rows: RowMeta, shards: int) -> torch.Tensor:
    """Physical order for sequence parallelism: shard i holds [noisy chunk i | clean chunk i]."""
    n = int((~rows.is_clean).sum())
    c = len(rows) - n
    if n % shards or c % shards:
        raise ValueError(
            f"--sequence-parallel with --tensor-model-parallel-size {shards} needs this rank's {n} noisy and "
            f"{c} clean rows to divide by {shards} (choose --seq-length/--block-size accordingly)"
        )
    parts = []
    for i in range(shards):
        parts.append(torch.arange(i * n // shards, (i + 1) * n // shards))
        parts.append(n + torch.arange(i * c // shards, (i + 1) * c // shards))
    return torch.cat(parts)
